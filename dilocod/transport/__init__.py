"""asyncio adapters for the wire protocol: listen, dial, sessions of one control connection plus N
data connections, fragment striping, authentication and TLS. Decisions about the protocol live in
dilocod.wire; this package only moves bytes, applies deadlines and backpressure. No torch here.
"""
