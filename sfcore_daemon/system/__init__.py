"""Operations around the daemon: logging, CPU pinning, the socket file, systemd
notification and the watchdog. Main thread and event loop; knows nothing of models."""
