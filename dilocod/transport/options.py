"""Transport tunables: deadlines, chunking, threads and buffer sizes, with the reasons for each."""

from __future__ import annotations

from dataclasses import dataclass

from dilocod.wire.limits import KiB, MiB


@dataclass(frozen=True, slots=True)
class TransportOptions:
    #: Chunk size: large enough that per-chunk overhead (two small reads, a checksum call) vanishes,
    #: small enough to stripe a fragment over many connections and compress on a thread pool.
    chunk_bytes: int = 1 * MiB
    #: Threads for compressing and decompressing chunks; zstd and lz4 release the GIL.
    codec_threads: int = 2
    #: Fixed socket buffers in bytes, or None to leave Linux autotuning (up to tcp_rmem max) on.
    socket_buffer_bytes: int | None = None
    congestion: str | None = "bbr"
    #: User-space bytes queued per connection before writers wait (pause_writing).
    write_buffer_high_bytes: int = 4 * MiB
    handshake_timeout_s: float = 10.0
    #: A peer that sends part of a frame and then nothing for this long is cut off.
    stall_timeout_s: float = 30.0
    #: Longest wait for a peer to drain what we wrote (a peer that stops reading).
    write_timeout_s: float = 60.0
    #: Longest wait for a receiver to acknowledge a whole fragment after its end marker.
    ack_timeout_s: float = 120.0
    #: Longest a receiver keeps an incomplete inbound transfer.
    transfer_timeout_s: float = 300.0
    #: A quiet session is pinged this often; silence for idle_timeout_s closes it.
    ping_interval_s: float = 5.0
    idle_timeout_s: float = 30.0
    #: Decodes queued behind the codec threads before data connections stop reading.
    max_pending_decodes: int = 16
    #: Control messages queued for the application before the control connection stops reading.
    max_queued_messages: int = 1024
    #: Answers to a peer's own frames (PONG, STREAM_RESET, FRAGMENT_ACK) that may wait unsent on
    #: one connection: a peer that goes on asking without reading is cut off beyond this. About
    #: 2000 PONGs; a peer that reads never comes near it.
    max_reply_backlog_bytes: int = 64 * KiB
