"""The syncer's global model: every fragment's parameters and Nesterov buffers in float32, laid out
exactly as the fragment travels on the wire, and the read-only snapshots that updates are sent from.

Layout. Fragment p's tensors are packed by wire.manifest.pack_manifest into one bytearray (the
"master"), with torch views onto it; the momentum buffer has the same layout. A push of fragment p
must carry exactly that manifest (float32 outer gradients), so its bytes are read in place.

Snapshots. Updates go out from a copy of the master made right after each merge, with its chunk
checksums computed in the same worker (hashed once, for every learner it is sent to). A snapshot
is lent to every send that uses it; the next merge of that fragment writes into a buffer nobody is
reading, so a slow learner never sees a half-merged fragment. Buffers are reused: a fresh 100 MB
allocation costs about six memcpys in page faults.

Commit. `merge` is the one place a merged fragment replaces the old one, and it does so only when
the new Θ_p and b_p are finite (outer.guard.l2_norm of each): otherwise both go back to what they
were (Θ_p from the current snapshot, which holds the master's version; b_p from a copy taken into
the snapshot-to-be first) and MergeRejected says why; nothing is published.

Threads. `merge` runs in the syncer's one merge worker thread, one at a time; it only touches the
fragment it is given and buffers the event loop handed it. `screen` runs in the screen thread and
reads only the push and the fragment's `norm`, a float the merge replaces whole. Everything else
runs on the event loop. Must not import networking or logging.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dilocod.outer import FragmentPlan, embedding_mask, outer_step_
from dilocod.outer.guard import (
    DEFAULT_MAX_FRAGMENT_RATIO,
    NON_FINITE_RESULT,
    NormSample,
    Verdict,
    check_outer_gradient,
    l2_norm,
)
from dilocod.precision import tensor_views
from dilocod.syncer.checkpoint import TensorPiece
from dilocod.wire.codecs import chunk_checksums
from dilocod.wire.manifest import ModelEntry, TensorEntry, pack_manifest


class ModelMismatch(ValueError):
    """A learner's (or a checkpoint's) parameters differ from the syncer's plan; names the first."""


class MergeRejected(Exception):
    """A merge was not committed: its result is not a model to serve. Θ_p, b_p and the version are
    as they were before it; reason is a guard reason (NON_FINITE_RESULT)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Snapshot:
    """One published version of a fragment, as sent: bytes and their chunk checksums."""

    version: int
    buffer: bytearray
    checksums: list[int]
    users: int = 0


@dataclass(slots=True)
class FragmentStore:
    index: int
    manifest: tuple[TensorEntry, ...]
    raw_bytes: int
    master: bytearray
    momentum: bytearray
    params: list[Tensor]
    momentum_views: list[Tensor]
    is_embedding: list[bool]
    #: The version the master holds (changed only by merge, in the worker).
    version: int = 0
    #: ‖Θ_p‖ at that version: the scale the screen bounds outer gradients by (set with the version).
    norm: float = 0.0
    current: Snapshot | None = None
    #: Snapshot buffers nobody reads any more, kept for the next merge of this fragment.
    spare: list[bytearray] = field(default_factory=list)
    #: Retired snapshots still lent to sends.
    retired: list[Snapshot] = field(default_factory=list)


class GlobalModel:
    """Θ, b and the snapshots of every fragment. Not thread-safe beyond what the docstring says."""

    def __init__(
        self,
        plan: FragmentPlan,
        specs: Sequence[ModelEntry],
        *,
        chunk_bytes: int,
        embedding_pattern: str,
    ) -> None:
        self.plan = plan
        self.specs = {s.name: s for s in specs}
        self.order = [s.name for s in specs]
        self.chunk_bytes = chunk_bytes
        self.fragments: list[FragmentStore] = []
        for fragment in plan.fragments:
            manifest, raw_bytes = pack_manifest([(n, "float32", self.specs[n].shape) for n in fragment.names])
            master, momentum = bytearray(raw_bytes), bytearray(raw_bytes)
            self.fragments.append(
                FragmentStore(
                    fragment.index,
                    tuple(manifest),
                    raw_bytes,
                    master,
                    momentum,
                    tensor_views(master, manifest),
                    tensor_views(momentum, manifest),
                    embedding_mask(fragment.names, embedding_pattern),
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
        (zeros when not given). Only before publish_all: a merge rolls Θ back to the snapshot."""
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
                for entry, param, buf in zip(store.manifest, store.params, store.momentum_views, strict=True):
                    param.copy_(params[entry.name])
                    if momentum is None:
                        buf.zero_()
                    else:
                        buf.copy_(momentum[entry.name])
                store.norm = l2_norm(store.params)

    @property
    def versions(self) -> list[int]:
        """What the master holds (read in the merge worker for a consistent checkpoint)."""
        return [store.version for store in self.fragments]

    def state(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Θ and b keyed by parameter name: views onto the live buffers (run in the merge worker)."""
        params: dict[str, Tensor] = {}
        momentum: dict[str, Tensor] = {}
        for store in self.fragments:
            for entry, param, buf in zip(store.manifest, store.params, store.momentum_views, strict=True):
                params[entry.name] = param
                momentum[entry.name] = buf
        return params, momentum

    def checkpoint_pieces(self, index: int) -> tuple[TensorPiece, ...]:
        """Where fragment index's bytes belong in a checkpoint: per tensor, the byte range of the
        tensor's data it holds and where that sits in the master (any thread: it never changes)."""
        return tuple(TensorPiece(e.name, 0, e.offset, e.nbytes) for e in self.fragments[index].manifest)

    def capture(self, index: int, params: memoryview, momentum: memoryview) -> int:
        """Copy Θ_p and b_p (master layout) into params and momentum and return the version they
        hold: one consistent fragment for a checkpoint (run in the merge worker, between merges)."""
        store = self.fragments[index]
        _copy_bytes(store.master, params)
        _copy_bytes(store.momentum, momentum)
        return store.version

    def publish_all(self) -> None:
        """Snapshot every fragment at its version (at start, before any learner is served)."""
        for store in self.fragments:
            target = self.spare_buffer(store.index)
            self.copy_out(store.index, target)
            checksums = chunk_checksums(target, self.chunk_bytes)
            self.publish(store.index, Snapshot(store.version, target, checksums))

    # ------------------------------------------------------------------ snapshots (event loop)

    def spare_buffer(self, index: int) -> bytearray:
        store = self.fragments[index]
        return store.spare.pop() if store.spare else bytearray(store.raw_bytes)

    def publish(self, index: int, snapshot: Snapshot) -> None:
        store = self.fragments[index]
        old, store.current = store.current, snapshot
        if old is not None:
            self._retire(store, old)

    def acquire(self, index: int) -> Snapshot:
        """The fragment's current snapshot, lent to one send until release()."""
        snapshot = self.fragments[index].current
        if snapshot is None:
            raise RuntimeError(f"fragment {index} has no snapshot yet")
        snapshot.users += 1
        return snapshot

    def release(self, index: int, snapshot: Snapshot) -> None:
        snapshot.users -= 1
        store = self.fragments[index]
        if snapshot in store.retired and snapshot.users == 0:
            store.retired.remove(snapshot)
            store.spare.append(snapshot.buffer)

    def _retire(self, store: FragmentStore, snapshot: Snapshot) -> None:
        if snapshot.users == 0:
            store.spare.append(snapshot.buffer)
        else:
            store.retired.append(snapshot)

    # ------------------------------------------------------------------ merge worker

    def copy_out(self, index: int, target: bytearray) -> None:
        _copy_bytes(self.fragments[index].master, target)

    def deltas(self, index: int, buffer: bytearray | memoryview) -> list[Tensor]:
        """The float32 tensors of a push of fragment index, read in place."""
        store = self.fragments[index]
        if len(buffer) != store.raw_bytes:
            raise ValueError(f"push of {len(buffer)} bytes for a fragment of {store.raw_bytes}")
        return tensor_views(buffer, store.manifest)

    def screen(
        self,
        index: int,
        buffer: bytearray | memoryview,
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
        pushes: Sequence[bytearray | memoryview],
        weights: Sequence[float],
        *,
        lr: float,
        mu: float,
        merge: str,
        target: bytearray,
        version: int,
    ) -> Snapshot:
        """Merge the pushes into Θ_p and step b_p and Θ_p in place, now at `version`; then copy
        Θ_p into target and hash it: the snapshot to publish. The pushes' contents are consumed.

        Raises MergeRejected, with Θ_p, b_p and the version as they were, when the new Θ_p or b_p
        holds a non-finite value (see the module docstring, Commit)."""
        store = self.fragments[index]
        current = store.current
        # The current snapshot is a copy of the master at its version (publish_all, and every
        # merge's own snapshot); without one (a merge before publish_all) Θ_p is copied here.
        saved_params = (
            current.buffer
            if current is not None and current.version == store.version
            else bytearray(store.master)
        )
        # target receives the new snapshot only at the end: until then it holds the old b_p.
        _copy_bytes(store.momentum, target)
        # The pushes are the syncer's own buffers, back to the pool right after: the merge may
        # write its intermediate direction into one of them instead of a scratch buffer, which saves
        # a fragment-sized write and read per round (bench/RESULTS.md §3).
        outer_step_(
            store.params,
            store.momentum_views,
            [self.deltas(index, buffer) for buffer in pushes],
            weights,
            lr,
            mu,
            merge=merge,
            is_embedding=store.is_embedding,
            consume_deltas=True,
        )
        norm = l2_norm(store.params)
        if not (math.isfinite(norm) and math.isfinite(l2_norm(store.momentum_views))):
            _copy_bytes(saved_params, store.master)
            _copy_bytes(target, store.momentum)
            raise MergeRejected(
                NON_FINITE_RESULT,
                f"fragment {index}: the merge for version {version} gave non-finite parameters or "
                f"momentum; not committed, the fragment stays at version {store.version}",
            )
        store.version = version
        store.norm = norm
        self.copy_out(index, target)
        return Snapshot(version, target, chunk_checksums(target, self.chunk_bytes))


def _copy_bytes(source: bytearray, target: bytearray | memoryview) -> None:
    if source:
        torch.frombuffer(target, dtype=torch.uint8).copy_(torch.frombuffer(source, dtype=torch.uint8))


def first_mismatch(ours: Sequence[ModelEntry], theirs: Sequence[ModelEntry]) -> str | None:
    """A sentence naming the first difference in names or shapes, or None. Dtypes may differ: the
    syncer keeps float32 and a learner may train in bf16."""
    mine = {s.name: s for s in ours}
    other = {s.name: s for s in theirs}
    for spec in ours:
        peer = other.get(spec.name)
        if peer is None:
            return f"parameter {spec.name!r} is missing from the learner's model"
        if peer.shape != spec.shape:
            theirs_shape, ours_shape = list(peer.shape), list(spec.shape)
            return (
                f"parameter {spec.name!r} has shape {theirs_shape} at the learner, {ours_shape} at the syncer"
            )
    for spec in theirs:
        if spec.name not in mine:
            return f"the learner's parameter {spec.name!r} is not in the syncer's model"
    return None
