"""Integration tests: real processes and real sockets on 127.0.0.1, no mocks."""
