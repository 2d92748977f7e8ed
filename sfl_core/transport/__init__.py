"""Network code both sides use, and only here: the MQTT link (paho, reconnects, chunking),
broker addresses (``mqtt://``/``mqtts://`` URLs, TLS files, password files) and the broker
options both CLIs share. The coordinator's transports and the agent's runner build on it;
nothing else in the project opens a socket."""
