"""Running a node: configuration, logs, metrics, systemd notify, and the runner tests and the demo use."""
