"""Network code both sides use, and only here: the MQTT link (paho, reconnects, chunking),
broker addresses (``mqtt://``/``mqtts://`` URLs, TLS files, password files) and the claim of a
name on a broker. The coordinator's transport and the agent's runner build on it; nothing else
in the project opens a socket (the command lines' broker options are ``cli.broker_options``)."""
