"""The syncer's global model: every fragment's parameters and Nesterov buffers in float32, laid out
exactly as the fragment travels on the wire, and the read-only snapshots that updates are sent from.

Layout. Fragment p's pieces (row slices of parameters, model.plan) are packed by
wire.manifest.fragment_manifest into one buffer (the "master": an anonymous map at first, a pooled
one from its first merge on), with torch views onto it; the momentum buffer has the same layout. A push
of fragment p must carry exactly that manifest (float32 outer gradients), so its bytes are read in
place. A parameter cut across fragments lives in several stores; `load` and `state` translate
between whole parameters and pieces.

Buffers. The steady state holds Θ and b (one master and one momentum buffer per fragment) and
fragment-sized buffers from one bounded pool (syncer.buffers): a push per contributing learner,
and per merge its two outputs (the new Θ_p and b_p). Nothing else holds a copy of the model.

Snapshots: new buffers on merge, never in place. What learners are sent is the master itself: a
Snapshot names the buffer that holds a version with its chunk checksums (hashed once, for every
learner it is sent to) and counts the sends reading it. A merge never writes the master it reads:
it steps from Θ_p into a pool buffer, which becomes the master when committed. So
a send of the old version goes on reading bytes nobody writes (a learner never receives a
half-merged fragment), a heal or idle send needs no copy at all, and the old master goes back to
the pool as soon as its last send is done (at once when none is reading it). The step reads Θ_p
and b_p and writes the new ones into pool buffers (outer_step_'s out=), so nothing is copied
before it. The other
discipline, merging in place and making a merge wait while a send reads the master, was rejected:
one slow learner (a 100 MB fragment over a thin link takes seconds) would stall every merge of
that fragment; stepping into new buffers costs no traffic beyond the step's own and, while a send
of the old version is still in flight, one fragment-sized buffer.

Updates at bf16 (--update-precision). The master stays float32; only what travels is rounded
(precision.recast, round to nearest even), with no error feedback: each round the learners re-anchor
on what they received. A version's encoding (an Encoding: a pool buffer of half a fragment and its
chunk checksums) is made once, in the merge worker right after the merge, and hangs on the
snapshot, shared by every send of that version. It goes back to the pool as soon as no send reads it
and no healed learner still waits for that version (the service says which with
release(keep_encoding=...)), or when its snapshot goes; a later send of a version whose encoding was
let go (a heal, a learner that reconnects) has `encode` make it again, in a worker thread, and the
service attaches it (attach_encoding). So beyond the fp32 design, the syncer holds an encoding per
version being sent: half a fragment each, in the room the merged pushes leave.

Commit. `merge` is the one place a merged fragment replaces the old one, and it does so only when
the new Θ_p and b_p are finite (their squared norms, summed from the step's own blocks; where
float32 squares overflow, outer.guard.l2_norm of the values decides): otherwise Θ_p and b_p were
never written (the new ones went into the merge's own buffers, which go back to the pool), and
MergeRejected says why; nothing is published. No copy or backup is needed for that.

Threads. `merge` runs in the syncer's one merge worker thread, one at a time; it only touches the
fragment it is given and buffers it takes from the pool; it replaces the master and its views but
not `current`, which only `publish` (on the event loop) moves. `screen` runs in the screen thread
and reads only the push and the fragment's `norm`, a float the merge replaces whole. The pool is
thread-safe. Everything else (publish, acquire, release) runs on the event loop. Must not import
networking or logging.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash
from torch import Tensor

from dilocod.model.plan import FragmentPlan
from dilocod.model.precision import recast, tensor_views
from dilocod.outer import embedding_mask, outer_step_
from dilocod.outer.guard import (
    DEFAULT_MAX_FRAGMENT_RATIO,
    NON_FINITE_RESULT,
    NormSample,
    Verdict,
    check_outer_gradient,
    l2_norm,
)
from dilocod.syncer.buffers import Buffer, BufferPool, zeroed
from dilocod.syncer.checkpoint import Lent, TensorPiece
from dilocod.wire.choices import UPDATE_PRECISIONS
from dilocod.wire.layouts import push_layout
from dilocod.wire.manifest import ModelEntry, TensorEntry, fragment_manifest, piece_rows


class ModelMismatch(ValueError):
    """A learner's (or a checkpoint's) parameters differ from the syncer's plan; names the first."""


class MergeRejected(Exception):
    """A merge was not committed: its result is not a model to serve. Θ_p, b_p and the version are
    as they were before it; reason is a guard reason (NON_FINITE_RESULT)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Encoding:
    """A version as it travels at a narrower precision: a pool buffer in the fragment's update
    layout and its chunk checksums."""

    buffer: Buffer
    checksums: list[int]


@dataclass(slots=True)
class Snapshot:
    """One version of a fragment as sent: the buffer that holds it (the master while it is the
    newest), its chunk checksums and its digest (xxh3-64 of all its bytes)."""

    version: int
    buffer: Buffer
    checksums: list[int]
    digest: int = 0
    #: Sends reading the buffer now (acquire/release, on the event loop).
    users: int = 0
    #: Superseded by publish: the buffer goes back to the pool when users reaches 0.
    retired: bool = False
    #: The version at the update precision when that is not fp32, while kept (see the docstring).
    encoding: Encoding | None = None


@dataclass(slots=True)
class FragmentStore:
    index: int
    #: (parameter name, start row, stop row) of each tensor of the manifest.
    pieces: tuple[tuple[str, int, int], ...]
    manifest: tuple[TensorEntry, ...]
    raw_bytes: int
    master: Buffer
    momentum: Buffer
    params: list[Tensor]
    momentum_views: list[Tensor]
    is_embedding: list[bool]
    #: The version the master holds (changed only by merge, in the worker).
    version: int = 0
    #: ‖Θ_p‖ at that version: the scale the screen bounds outer gradients by (set with the version).
    norm: float = 0.0
    #: The newest published version, what sends acquire (moved only by publish, on the loop).
    current: Snapshot | None = None
    #: How updates of this fragment travel: the manifest and size at the update precision (the
    #: fp32 ones when that is fp32).
    update_manifest: tuple[TensorEntry, ...] = ()
    update_bytes: int = 0


class GlobalModel:
    """Θ, b and the snapshots of every fragment. Not thread-safe beyond what the docstring says."""

    def __init__(
        self,
        plan: FragmentPlan,
        specs: Sequence[ModelEntry],
        *,
        chunk_bytes: int,
        embedding_pattern: str,
        update_precision: str = "fp32",
    ) -> None:
        if update_precision not in UPDATE_PRECISIONS:
            raise ValueError(
                f"update precision must be {' or '.join(UPDATE_PRECISIONS)}, not {update_precision!r}"
            )
        self.plan = plan
        self.update_precision = update_precision
        self.specs = {s.name: s for s in specs}
        self.order = [s.name for s in specs]
        self.chunk_bytes = chunk_bytes
        #: Every fragment-sized buffer beyond Θ and b comes from here (see Buffers).
        self.buffers = BufferPool()
        # Masters and momenta lent to a checkpoint (by id: how many lends), and those retired by a
        # merge while lent, given back when the last lend ends. The lock also makes a merge's
        # commit of Θ_p, b_p and the version one step for a lender.
        self._lent_lock = threading.Lock()
        self._lent: dict[int, int] = {}
        self._retired: dict[int, Buffer] = {}
        self.fragments: list[FragmentStore] = []
        shapes = {s.name: s.shape for s in specs}
        for fragment in plan.fragments:
            manifest, raw_bytes = fragment_manifest(fragment.pieces, shapes)
            master, momentum = zeroed(raw_bytes), zeroed(raw_bytes)
            update_manifest, update_bytes = manifest, raw_bytes
            if update_precision != "fp32":
                shapes_of = [(entry.name, entry.shape) for entry in manifest]
                update_manifest, update_bytes = push_layout(shapes_of, update_precision)
            self.fragments.append(
                FragmentStore(
                    fragment.index,
                    tuple(fragment.pieces),
                    manifest,
                    raw_bytes,
                    master,
                    momentum,
                    tensor_views(master, manifest),
                    tensor_views(momentum, manifest),
                    embedding_mask([piece.name for piece in fragment.pieces], embedding_pattern),
                    update_manifest=update_manifest,
                    update_bytes=update_bytes,
                )
            )

    # ------------------------------------------------------------------ state

    def load(
        self,
        params: Mapping[str, Tensor],
        momentum: Mapping[str, Tensor] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        """Fill Θ (and b, zeros when not given) from tensors keyed by parameter name, at versions
        (zeros when not given). Only before publish_all: after it, the masters are what learners are sent."""
        if any(store.current is not None for store in self.fragments):
            raise RuntimeError("load() after publish_all(): the snapshots would hold another model")
        if versions is not None and len(versions) != len(self.fragments):
            raise ModelMismatch(f"{len(versions)} versions for {len(self.fragments)} fragments")
        for name in self.order:
            if name not in params:
                raise ModelMismatch(f"parameter {name!r} is missing")
            shape = tuple(params[name].shape)
            if shape != self.specs[name].shape:
                raise ModelMismatch(
                    f"parameter {name!r} has shape {shape}, the plan has {self.specs[name].shape}"
                )
        extra = sorted(set(params) - set(self.specs))
        if extra:
            raise ModelMismatch(f"parameter {extra[0]!r} is not in the plan")
        with torch.no_grad():
            for store in self.fragments:
                store.version = 0 if versions is None else versions[store.index]
                for piece, param, buf in zip(store.pieces, store.params, store.momentum_views, strict=True):
                    param.copy_(rows(params[piece[0]], piece))
                    if momentum is not None:
                        buf.copy_(rows(momentum[piece[0]], piece))
                if momentum is None:
                    # b = 0 as a fresh map, never written or even read here: its pages are mapped
                    # only when the first merge writes b_p, so a syncer that starts from its entry
                    # peaks at the entry's model plus Θ, not plus Θ and b.
                    store.momentum = zeroed(store.raw_bytes)
                    store.momentum_views = tensor_views(store.momentum, store.manifest)
                store.norm = l2_norm(store.params)

    @property
    def versions(self) -> list[int]:
        """What the master holds (read in the merge worker for a consistent checkpoint)."""
        return [store.version for store in self.fragments]

    def state(self) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
        """Θ and b keyed by parameter name, each the views onto the live buffers of its pieces in
        row order (their concatenation along dim 0 is the parameter; run in the merge worker)."""
        parts: dict[str, list[tuple[int, Tensor, Tensor]]] = {name: [] for name in self.order}
        for store in self.fragments:
            for piece, param, buf in zip(store.pieces, store.params, store.momentum_views, strict=True):
                parts[piece[0]].append((piece[1], param, buf))
        params: dict[str, list[Tensor]] = {}
        momentum: dict[str, list[Tensor]] = {}
        for name, found in parts.items():
            found.sort(key=lambda part: part[0])
            params[name] = [param for _, param, _ in found]
            momentum[name] = [buf for _, _, buf in found]
        return params, momentum

    def checkpoint_pieces(self, index: int) -> tuple[TensorPiece, ...]:
        """Where fragment index's bytes belong in a checkpoint: per tensor, the byte range of the
        tensor's data it holds and where that sits in the master (any thread: it never changes)."""
        store = self.fragments[index]
        pieces = []
        for (name, start, _), entry in zip(store.pieces, store.manifest, strict=True):
            row_bytes = 4 * math.prod(self.specs[name].shape[1:]) if self.specs[name].shape else 0
            pieces.append(TensorPiece(name, start * row_bytes, entry.offset, entry.nbytes))
        return tuple(pieces)

    @contextlib.contextmanager
    def lend(self, index: int) -> Iterator[Lent]:
        """Θ_p and b_p (master layout) and the version they hold, lent for a checkpoint to read
        until the context exits: one consistent fragment, with no copy. Any thread: a merge
        commits new buffers and never writes committed ones, and the buffers it retires while they
        are lent go back to the pool only when the lender is done with them."""
        store = self.fragments[index]
        with self._lent_lock:
            master, momentum, version = store.master, store.momentum, store.version
            for buffer in (master, momentum):
                self._lent[id(buffer)] = self._lent.get(id(buffer), 0) + 1
        try:
            yield Lent(memoryview(master), memoryview(momentum), version)
        finally:
            back = []
            with self._lent_lock:
                for buffer in (master, momentum):
                    count = self._lent[id(buffer)] - 1
                    if count:
                        self._lent[id(buffer)] = count
                    else:
                        del self._lent[id(buffer)]
                        if self._retired.pop(id(buffer), None) is not None:
                            back.append(buffer)
            for buffer in back:
                self.buffers.give(buffer)

    def _retire(self, buffer: Buffer) -> None:
        """A master or momentum nobody reads any more (but a lender, maybe) back to the pool."""
        with self._lent_lock:
            if id(buffer) in self._lent:
                self._retired[id(buffer)] = buffer
                return
        self.buffers.give(buffer)

    def publish_all(self) -> None:
        """Publish every fragment at its version, from its master (at start, before any learner is
        served; hashing only, no copy)."""
        for store in self.fragments:
            checksums, digest = hash_fragment(store.master, self.chunk_bytes)
            store.current = Snapshot(store.version, store.master, checksums, digest)

    # ------------------------------------------------------------------ snapshots (event loop)

    def publish(self, index: int, snapshot: Snapshot) -> None:
        """Make a merge's snapshot the one sends acquire; the one it supersedes goes back to the
        pool once no send reads it."""
        store = self.fragments[index]
        old, store.current = store.current, snapshot
        if old is not None:
            old.retired = True
            if old.users == 0:
                self._retire(old.buffer)
                self._drop_encoding(old)

    def acquire(self, index: int) -> Snapshot:
        """The fragment's current snapshot, lent to one send until release()."""
        snapshot = self.fragments[index].current
        if snapshot is None:
            raise RuntimeError(f"fragment {index} has no snapshot yet")
        snapshot.users += 1
        return snapshot

    def release(self, index: int, snapshot: Snapshot, *, keep_encoding: bool = True) -> None:
        """One send fewer reads the snapshot. keep_encoding=False: once no send reads it, its
        encoding goes back to the pool (no learner waits for that version any more)."""
        if snapshot.users <= 0:
            raise RuntimeError(f"fragment {index}: a snapshot released more often than acquired")
        snapshot.users -= 1
        if snapshot.users:
            return
        if snapshot.retired:
            self._retire(snapshot.buffer)
            self._drop_encoding(snapshot)
        elif not keep_encoding:
            self._drop_encoding(snapshot)

    def attach_encoding(self, snapshot: Snapshot, encoding: Encoding) -> Encoding:
        """Keep an encoding made by `encode` on its snapshot; the one kept there already wins (this
        one goes back to the pool), and a snapshot that has gone keeps none. Returns the kept one."""
        if snapshot.encoding is not None or (snapshot.retired and snapshot.users == 0):
            self.buffers.give(encoding.buffer)
        else:
            snapshot.encoding = encoding
        return snapshot.encoding if snapshot.encoding is not None else encoding

    def _drop_encoding(self, snapshot: Snapshot) -> None:
        if snapshot.encoding is not None:
            self.buffers.give(snapshot.encoding.buffer)
            snapshot.encoding = None

    # ------------------------------------------------------------------ worker threads

    def encode(self, index: int, buffer: Buffer) -> Encoding:
        """A version's bytes (a snapshot's buffer, which nobody writes) at the update precision, in
        a pool buffer, with its chunk checksums. Runs in a worker thread, never on the event loop."""
        store = self.fragments[index]
        out = self.buffers.take(store.update_bytes)
        try:
            recast(buffer, store.manifest, out, store.update_manifest)
        except BaseException:
            self.buffers.give(out)
            raise
        return Encoding(out, hash_fragment(out, self.chunk_bytes)[0])

    # ------------------------------------------------------------------ merge worker

    def deltas(self, index: int, buffer: Buffer | memoryview) -> list[Tensor]:
        """The float32 tensors of a push of fragment index, read in place."""
        store = self.fragments[index]
        if len(buffer) != store.raw_bytes:
            raise ValueError(f"push of {len(buffer)} bytes for a fragment of {store.raw_bytes}")
        return tensor_views(buffer, store.manifest)

    def screen(
        self,
        index: int,
        buffer: Buffer | memoryview,
        history: Sequence[NormSample],
        max_norm_ratio: float,
        max_fragment_ratio: float = DEFAULT_MAX_FRAGMENT_RATIO,
        *,
        steps: int,
    ) -> Verdict:
        """Screen a push of fragment index, carrying `steps` inner steps, against ‖Θ_p‖ at its
        latest merge and the fragment's norm history."""
        return check_outer_gradient(
            self.deltas(index, buffer),
            history,
            steps=steps,
            fragment_norm=self.fragments[index].norm,
            max_fragment_ratio=max_fragment_ratio,
            max_norm_ratio=max_norm_ratio,
        )

    def merge(
        self,
        index: int,
        pushes: Sequence[Buffer | memoryview],
        weights: Sequence[float],
        *,
        lr: float,
        mu: float,
        merge: str,
        version: int,
    ) -> Snapshot:
        """Merge the pushes and take the Nesterov step from Θ_p and b_p into two pool buffers,
        commit them as the new master and momentum at `version` and hash the master: the snapshot
        to publish. The pushes' contents are consumed.

        Raises MergeRejected, with Θ_p, b_p and the version as they were, when the new Θ_p or b_p
        holds a non-finite value (see the module docstring, Commit)."""
        store = self.fragments[index]
        target = self.buffers.take(store.raw_bytes)
        momentum = self.buffers.take(store.raw_bytes)
        try:
            params = tensor_views(target, store.manifest)
            momentum_views = tensor_views(momentum, store.manifest)
            # The pushes are the syncer's own buffers, back to the pool right after: the merge may
            # write its intermediate direction into one of them instead of a scratch buffer, which
            # saves a fragment-sized write and read per round (bench/RESULTS.md §3). Θ_p and b_p
            # are only read; their squared norms come from the step's own blocks.
            norms = outer_step_(
                store.params,
                store.momentum_views,
                [self.deltas(index, buffer) for buffer in pushes],
                weights,
                lr,
                mu,
                merge=merge,
                is_embedding=store.is_embedding,
                consume_deltas=True,
                out=(params, momentum_views),
                want_norms=True,
            )
            assert norms is not None
            norm = math.sqrt(norms[0])
            if not (math.isfinite(norm) and math.isfinite(norms[1])):
                # float32 squares overflow above about 1e19 though the values are finite: decide
                # on the values themselves (a pass over each, only in this rare case).
                norm = l2_norm(params)
                if not (math.isfinite(norm) and math.isfinite(l2_norm(momentum_views))):
                    raise MergeRejected(
                        NON_FINITE_RESULT,
                        f"fragment {index}: the merge for version {version} gave non-finite "
                        f"parameters or momentum; not committed, the fragment stays at version "
                        f"{store.version}",
                    )
        except BaseException:
            # Rejected, or failed part way (a bug): Θ_p and b_p were never written.
            self.buffers.give(target)
            self.buffers.give(momentum)
            raise
        checksums, digest = hash_fragment(target, self.chunk_bytes)
        with self._lent_lock:  # Θ_p, b_p and the version move together (see lend)
            old, old_momentum = store.master, store.momentum
            store.momentum, store.momentum_views = momentum, momentum_views
            store.master, store.params, store.version, store.norm = target, params, version, norm
        self._retire(old_momentum)
        if store.current is None:  # not published yet (a merge before publish_all): nobody reads it
            self._retire(old)
        # Otherwise the old master is the current snapshot's buffer: publish() retires it.
        snapshot = Snapshot(version, target, checksums, digest)
        if self.update_precision != "fp32":
            # Once per version, here in the worker (after the old momentum went back to the pool:
            # half a fragment more, not one and a half): every learner is sent this version next. The
            # merge is committed by now; an encoding that cannot be made here is made by the sends.
            with contextlib.suppress(Exception):
                snapshot.encoding = self.encode(index, target)
        return snapshot


def rows(tensor: Tensor, piece: tuple[str, int, int]) -> Tensor:
    """The rows of a whole parameter a piece holds, as a view (a tensor without rows is whole)."""
    _, start, stop = piece
    if (start, stop) == (0, piece_rows(tensor.shape)):
        return tensor
    return tensor[start:stop]


def hash_fragment(buffer: Buffer, chunk_bytes: int) -> tuple[list[int], int]:
    """The chunk checksums (as wire.codecs.chunk_checksums) and the digest (xxh3-64 of all the
    bytes) in one pass over memory: each chunk is hashed again for the digest while in cache."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk size must be positive, not {chunk_bytes}")
    view = memoryview(buffer).cast("B")
    whole = xxhash.xxh3_64()
    checksums = []
    for start in range(0, len(view), chunk_bytes):
        chunk = view[start : start + chunk_bytes]
        checksums.append(xxhash.xxh3_64_intdigest(chunk))
        whole.update(chunk)
    return checksums, whole.intdigest()
