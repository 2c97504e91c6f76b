"""The syncer's rule for a JOIN under the id of a session it still holds (SPEC §4.4): refused
while the old session is heard from within the liveness timeout, with a message that names the id
and says when a retry can succeed; taken over once the old session has been silent that long (a
learner whose host lost power leaves a half-open connection); always taken over by the same learner
process coming back. The real processes are in tests/integration/test_learner_ids.py."""

from __future__ import annotations

import pytest

from dilocod.syncer.service import id_in_use_refusal

LIVENESS_S = 30.0


def test_a_live_holder_keeps_its_id() -> None:
    message = id_in_use_refusal("m1", same_instance=False, quiet_s=0.42, liveness_s=LIVENESS_S)
    assert message is not None
    assert "learner id 'm1' is in use" in message
    assert "heard from 0.4 s ago" in message
    assert message.endswith("retry in 30 s")


@pytest.mark.parametrize(("quiet_s", "retry_s"), [(12.2, 18), (29.9, 1)])
def test_the_retry_time_is_when_the_holder_would_count_as_silent(quiet_s: float, retry_s: int) -> None:
    """A holder that died silently (a power loss: no FIN, no RST) stops holding the id once it has
    been silent for the liveness timeout; the refusal says how long that is from now."""
    message = id_in_use_refusal("m1", same_instance=False, quiet_s=quiet_s, liveness_s=LIVENESS_S)
    assert message is not None and message.endswith(f"retry in {retry_s} s")


def test_a_silent_holder_is_replaced() -> None:
    assert id_in_use_refusal("m1", same_instance=False, quiet_s=LIVENESS_S, liveness_s=LIVENESS_S) is None
    assert id_in_use_refusal("m1", same_instance=False, quiet_s=95.0, liveness_s=LIVENESS_S) is None


def test_the_same_learner_coming_back_replaces_its_old_session() -> None:
    assert id_in_use_refusal("m1", same_instance=True, quiet_s=0.01, liveness_s=LIVENESS_S) is None


def test_the_message_fits_an_error_frame() -> None:
    message = id_in_use_refusal("x" * 128, same_instance=False, quiet_s=0.0, liveness_s=LIVENESS_S)
    assert message is not None and len(message.encode()) <= 1024
