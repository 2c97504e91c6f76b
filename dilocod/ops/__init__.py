"""Operations: what every command shares on its command line (commandline.py), structlog setup,
Prometheus metrics, systemd notify and watchdog, `dilocod status`, and the CPU priority of helper
threads."""
