"""How many intra-op threads torch gets in a learner (dilocod.learner.threads): one core is left to
the network wherever it runs on the host, the rest shared among the host's ranks, never more than
torch's own default; what the user chose (OMP_NUM_THREADS, torch.set_num_threads in the entry) is
kept."""

from __future__ import annotations

import pytest

from dilocod.learner.threads import HostCpus, choose_intra_op_threads


@pytest.mark.parametrize(
    ("cores", "network", "local_world_size", "torch_default", "want"),
    [
        pytest.param(2, "process", 1, 2, 1, id="small-host-network-process"),
        pytest.param(2, "thread", 1, 2, 1, id="small-host-network-thread"),
        pytest.param(1, "process", 1, 1, 1, id="one-core-never-zero"),
        pytest.param(16, "process", 1, 8, 8, id="hyperthreads-capped-at-torchs-default"),
        pytest.param(8, "process", 1, 8, 7, id="eight-cores"),
        pytest.param(8, None, 1, 8, 8, id="no-network-on-this-host"),
        pytest.param(16, "process", 4, 16, 3, id="torchrun-four-ranks"),
        pytest.param(16, None, 4, 16, 4, id="torchrun-four-ranks-other-node"),
        pytest.param(4, "process", 4, 4, 1, id="a-core-per-rank-at-least"),
        pytest.param(4, "process", 8, 4, 1, id="more-ranks-than-cores"),
    ],
)
def test_the_network_gets_a_core_and_the_ranks_share_the_rest(
    cores: int, network: str | None, local_world_size: int, torch_default: int, want: int
) -> None:
    choice = choose_intra_op_threads(
        HostCpus(cores, local_world_size), network, torch_default=torch_default, current=torch_default
    )
    assert choice.threads == want
    assert f"{cores} cores" in choice.reason
    if network is not None and cores > local_world_size:
        assert f"1 for the network {network}" in choice.reason
    if local_world_size > 1:
        assert f"{local_world_size} ranks" in choice.reason


def test_an_explicit_omp_num_threads_is_kept() -> None:
    choice = choose_intra_op_threads(
        HostCpus(2, 1, omp_num_threads="2"), "process", torch_default=2, current=2
    )
    assert choice.threads is None and "OMP_NUM_THREADS=2" in choice.reason


def test_an_empty_omp_num_threads_is_not_a_choice() -> None:
    choice = choose_intra_op_threads(
        HostCpus(2, 1, omp_num_threads=""), "process", torch_default=2, current=2
    )
    assert choice.threads == 1


def test_the_entrys_own_set_num_threads_is_kept() -> None:
    choice = choose_intra_op_threads(HostCpus(8), "process", torch_default=8, current=4)
    assert choice.threads is None and "torch.set_num_threads(4)" in choice.reason
