"""Security by default, the parts that need no network: nothing in the package unpickles, evaluates
or executes what it reads (an AST scan, checked on bad snippets too so a broken scan cannot pass);
state files that carry code are refused with a clear error and the code never runs; the island's
control encoding carries exactly its values; and the rule that beyond loopback a secret or TLS is
required unless --insecure is given.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import dilocod
from dilocod.config import Address, ConfigError, parse_address, require_authentication, tls_paths
from dilocod.learner.bridge import Adopt, Inbox, LostPush
from dilocod.learner.control import Control, ControlError, UpdateNote, decode_control, encode_control
from dilocod.learner.state import FORMAT, STATE_FILE, LocalStateError, load_local_state
from dilocod.syncer import checkpoint
from dilocod.syncer.checkpoint import (
    CHECKPOINTS_DIR,
    MODEL_FILE,
    DamagedCheckpointsError,
    SyncerState,
    export_model,
    load_latest_checkpoint,
    save_checkpoint,
)
from dilocod.wire.manifest import ModelEntry
from dilocod.wire.messages import FragmentRequest, Plan

PACKAGE = Path(dilocod.__file__).parent

# ------------------------------------------------------------------------- the source scan

#: Modules whose loaders build arbitrary objects (run code) from bytes.
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
#: Names that may be imported from those modules: exception classes, which unpickle nothing.
HARMLESS_NAMES = {"UnpicklingError", "PicklingError"}
#: torch.distributed collectives that pickle their objects.
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}
CODE_BUILTINS = {"eval", "exec", "compile", "__import__"}
TORCH_LOADS = {"load", "serialization.load"}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _weights_only(call: ast.Call) -> bool:
    return any(
        kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
        for kw in call.keywords
    )


def unsafe_uses(source: str, filename: str = "<snippet>") -> list[str]:
    """Every place in source that could turn bytes into code: pickle-family imports, torch.load
    without weights_only=True, torch's object collectives, eval/exec/compile/__import__, and
    allow_pickle / pickle_module / yaml.load."""
    tree = ast.parse(source, filename)
    torch_names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names.update(a.asname for a in node.names if a.name == "torch" and a.asname)
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [
                f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES
            ]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for alias in node.names:
                unpickler = module.split(".")[0] in UNSAFE_MODULES and alias.name not in HARMLESS_NAMES
                hidden_torch_load = module.startswith("torch") and alias.name == "load"
                if unpickler or hidden_torch_load or alias.name in OBJECT_COLLECTIVES:
                    found.append(f"{where}: from {module} import {alias.name}")
        elif isinstance(node, ast.Name) and node.id in CODE_BUILTINS:
            found.append(f"{where}: {node.id}")
        elif isinstance(node, ast.Attribute):
            if node.attr in OBJECT_COLLECTIVES:
                found.append(f"{where}: {node.attr} (pickles its objects)")
            elif node.attr in CODE_BUILTINS and _dotted(node.value) == "builtins":
                found.append(f"{where}: builtins.{node.attr}")
        if isinstance(node, ast.Call):
            name = _dotted(node.func) or ""
            head, _, rest = name.partition(".")
            if head in torch_names and rest in TORCH_LOADS and not _weights_only(node):
                found.append(f"{where}: {name} without weights_only=True")
            if name in {"yaml.load", "yaml.unsafe_load", "yaml.full_load"}:
                found.append(f"{where}: {name}")
            for kw in node.keywords:
                if kw.arg == "pickle_module" or (
                    kw.arg == "allow_pickle"
                    and not (isinstance(kw.value, ast.Constant) and not kw.value.value)
                ):
                    found.append(f"{where}: {name}({kw.arg}=...)")
    return found


def test_the_package_never_turns_bytes_into_code() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50, f"the scan found only {len(files)} files under {PACKAGE}"
    found = [use for path in files for use in unsafe_uses(path.read_text(), str(path.relative_to(PACKAGE)))]
    assert found == [], "unsafe deserialisation or code execution:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import _pickle as fast",
        "import dill",
        "from pickle import loads",
        "from marshal import loads",
        "import torch\ntorch.load(path)",
        "import torch\ntorch.load(path, weights_only=False)",
        "import torch as t\nt.load(path, map_location='cpu')",
        "import torch\ntorch.serialization.load(path)",
        "from torch import load",
        "import torch.distributed as dist\ndist.broadcast_object_list(values, src=0)",
        "from torch.distributed import all_gather_object",
        "eval(text)",
        "exec(code)",
        "compile(text, 'f', 'exec')",
        "__import__(name)",
        "import builtins\nbuiltins.eval(text)",
        "import numpy\nnumpy.load(path, allow_pickle=True)",
        "import torch\ntorch.save(obj, f, pickle_module=other)",
        "import yaml\nyaml.load(text)",
    ],
)
def test_the_scan_catches_each_unsafe_form(snippet: str) -> None:
    assert unsafe_uses(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load(path, map_location='cpu', weights_only=True)",
        "model.eval()",
        "import re\nre.compile('x')",
        "from pickle import UnpicklingError",
        "import numpy\nnumpy.load(path, allow_pickle=False)",
        "import importlib\nimportlib.import_module(name)",
    ],
)
def test_the_scan_passes_safe_forms(snippet: str) -> None:
    assert unsafe_uses(snippet) == []


# ------------------------------------------------------------------- state files carrying code


class RunsCode:
    """Pickles to a call of os.mkdir(marker): whoever unpickles it creates the marker directory."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.marker,))


def test_a_learner_state_file_carrying_code_is_refused_and_the_code_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / STATE_FILE
    torch.save({"format": FORMAT, "step": 7, "model": {"w": torch.ones(2)}, "cursor": RunsCode(marker)}, path)
    with pytest.raises(LocalStateError) as refused:
        load_local_state(tmp_path)
    message = str(refused.value)
    assert str(path) in message and "posix.mkdir" in message and "could run code" in message
    assert "weights_only=False" not in message  # torch's own advice is the one thing not to follow
    assert not marker.exists()
    # The file is live: a plain unpickling would have run it (so the refusal above is what saved us).
    torch.load(path, weights_only=False)
    assert marker.is_dir()


def test_a_syncer_checkpoint_carrying_code_is_refused_and_the_code_never_runs(tmp_path: Path) -> None:
    """A checkpoint whose model file is a pickle with code, its size and digest re-recorded so that
    only the format can stop it: it is skipped as not loading, for loading and for export alike."""
    params = {"w": torch.ones(3)}
    saved = save_checkpoint(tmp_path, SyncerState(params, {"w": torch.zeros(3)}, [0], {}))
    marker = tmp_path / "code-ran"
    model_file = saved / MODEL_FILE
    torch.save({"w": torch.ones(3), "payload": RunsCode(marker)}, model_file)
    document = json.loads((saved / checkpoint.STATE_FILE).read_text())
    data = model_file.read_bytes()
    document["files"][MODEL_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (saved / checkpoint.STATE_FILE).write_text(json.dumps(document))

    with pytest.raises(DamagedCheckpointsError) as refused:
        load_latest_checkpoint(tmp_path)
    assert f"{saved.name}: {MODEL_FILE} does not load" in str(refused.value)
    assert str(tmp_path / CHECKPOINTS_DIR) in str(refused.value)
    # export copies the recorded bytes without interpreting them; what it writes loads through
    # safetensors only, which refuses it.
    out = export_model(tmp_path, tmp_path / "export.safetensors")
    with pytest.raises(SafetensorError):
        load_file(str(out))
    assert not marker.exists()


# ----------------------------------------------------------------------- the island's control


def _inbox() -> Inbox:
    model = (ModelEntry("a", "float32", (2, 3)), ModelEntry("b", "float32", (4,)))
    plan = Plan("inc-1", model, ((("a", 0, 2),), (("b", 0, 4),)), (3, 0), 24, 2, 1)
    updates = [
        Adopt(0, 3, bytearray(24), True, "inc-1"),
        Adopt(1, 1, bytearray(16), False, "inc-1"),
        Adopt(1, 2, bytearray(), False, ""),
    ]
    return Inbox(plan, updates, [FragmentRequest(1, 9, 2)], "a fatal reason", [LostPush(1, 7)])


def test_island_control_round_trips_exactly_its_values() -> None:
    inbox = _inbox()
    control = decode_control(encode_control(inbox))
    notes = tuple(
        UpdateNote(u.fragment, u.version, u.heal, u.incarnation, len(u.buffer)) for u in inbox.updates
    )
    assert control == Control(inbox.plan, notes, tuple(inbox.requests), inbox.fatal, (LostPush(1, 7),))
    assert decode_control(encode_control(Inbox())) == Control(None, (), (), None)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x04\x95",  # the start of a pickle stream
        b"\xc1",  # not msgpack
        b"\x90",  # an array, not a map
        bytes([0x84])
        + b"".join(bytes([0xA0 + len(k)]) + k + b"\xc0" for k in (b"plan", b"updates", b"x", b"fatal")),
        bytes([0x84])  # the keys of a control from before lost pushes
        + b"".join(
            bytes([0xA0 + len(k)]) + k + b"\xc0" for k in (b"plan", b"updates", b"requests", b"fatal")
        ),
    ],
)
def test_island_control_refuses_anything_else(payload: bytes) -> None:
    with pytest.raises(ControlError):
        decode_control(payload)


def test_island_control_checks_every_value() -> None:
    import msgpack

    good = msgpack.unpackb(encode_control(_inbox()), raw=False)
    for key, value in [
        ("updates", [[0, 3, 1, "inc", 24]]),  # heal must be a bool, not an int
        ("updates", [[True, 3, True, "inc", 24]]),  # a fragment must be an int, not a bool
        ("updates", [[0, -1, True, "inc", 24]]),
        ("updates", [[0, 3, True, "inc"]]),
        ("requests", [b"\x80"]),  # a FRAGMENT_REQUEST's wire body: requests are arrays of integers
        ("requests", [[1, 9]]),  # a request missing its version
        ("requests", [[True, 9, 2]]),
        ("requests", [[1, -9, 2]]),
        ("requests", [[2**32, 9, 2]]),  # a fragment index outside the wire's 32 bits
        ("requests", [[1, 9.0, 2]]),
        ("requests", "not an array"),
        ("plan", b"\x81\xa1x\x01"),
        ("fatal", 3),
        ("lost", [[1]]),
        ("lost", [[True, 7]]),
        ("lost", [[1, -7]]),
        ("lost", "not an array"),
    ]:
        with pytest.raises(ControlError):
            decode_control(msgpack.packb({**good, key: value}, use_bin_type=True))


# ------------------------------------------------------------------ authentication required


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("localhost", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.7", False),
        ("syncer.example", False),
        ("127.evil.example", False),  # a name, whatever it starts with: it may resolve anywhere
    ],
)
def test_what_counts_as_loopback(host: str, loopback: bool) -> None:
    assert Address(host, 7070).is_loopback is loopback


def _require(
    target: str, *, listening: bool = True, secret: bool = False, tls: bool = False, insecure: bool = False
) -> None:
    address = parse_address(target, key="--listen")
    require_authentication(address, listening=listening, secret=secret, tls=tls, insecure=insecure)


def test_beyond_loopback_a_secret_or_tls_is_required_unless_insecure() -> None:
    for listening in (True, False):
        with pytest.raises(ConfigError) as refused:
            _require("0.0.0.0:7070", listening=listening)
        message = str(refused.value)
        assert ("listening on" if listening else "connecting to") in message
        assert "--secret-file FILE" in message and "--tls-cert" in message and "--insecure" in message
        _require("10.0.0.7:7070", listening=listening, secret=True)
        _require("10.0.0.7:7070", listening=listening, tls=True)
        _require("10.0.0.7:7070", listening=listening, secret=True, tls=True)
        _require("10.0.0.7:7070", listening=listening, insecure=True)
        _require("127.0.0.1:7070", listening=listening)  # loopback: nothing needed
    with pytest.raises(ConfigError, match="--secret-file and --insecure exclude each other"):
        _require("127.0.0.1:7070", secret=True, insecure=True)
    with pytest.raises(ConfigError, match="--tls-cert/--tls-key/--tls-ca and --insecure exclude each other"):
        _require("127.0.0.1:7070", tls=True, insecure=True)


def test_tls_files_go_together() -> None:
    assert tls_paths(None, None, None) is None
    files = (Path("c.pem"), Path("k.pem"), Path("ca.pem"))
    assert tls_paths(*files) == files
    with pytest.raises(ConfigError, match="--tls-key, --tls-ca missing"):
        tls_paths(Path("c.pem"), None, None)
