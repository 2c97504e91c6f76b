"""Sans-IO implementation of the dilocod wire protocol (protocol/SPEC.md).

Frames, typed messages, limits, chunk codecs, fragment stream bookkeeping and the connection state
machine. Nothing in this package does I/O: it must not import asyncio, socket, torch or logging.
"""
