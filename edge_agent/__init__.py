"""The edge agent (`sfl-agent start`): protocol state machine, MQTT runner, profiler, the device's own data."""
