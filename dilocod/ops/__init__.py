"""Operations glue: status queries, and later logging, metrics, systemd notify and signals."""
