"""SGP's communication graphs: valid peers and column-stochastic mixing for any n."""
import numpy as np
import pytest

from hvd_compress import gossip


@pytest.mark.parametrize("graph", gossip.GRAPHS)
@pytest.mark.parametrize("size", range(2, 10))
def test_every_step_mixes_column_stochastically(graph, size):
    for step in range(12):
        matrix = gossip.mixing_matrix(graph, size, step)
        np.testing.assert_allclose(matrix.sum(axis=0), 1.0)  # every rank gives away all its mass
        assert np.all(matrix >= 0)
        for rank in range(size):
            peers = gossip.out_peers(graph, rank, size, step)
            assert rank not in peers and len(set(peers)) == len(peers) and all(0 <= p < size for p in peers)


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_one_peer_exponential_graph_averages_exactly_in_log2_n_steps(size):
    product = np.eye(size)
    for step in range(int(np.log2(size))):
        product = gossip.mixing_matrix("exponential", size, step) @ product
    np.testing.assert_allclose(product, np.full((size, size), 1.0 / size))


@pytest.mark.parametrize("size", [3, 5, 6, 7])
def test_other_sizes_converge_geometrically(size):
    product, errors = np.eye(size), []
    for step in range(40):
        product = gossip.mixing_matrix("exponential", size, step) @ product
        errors.append(np.abs(product - 1.0 / size).max())
    assert errors[-1] < 1e-6 and errors[-1] < errors[9] < errors[0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="graph must be one of"):
        gossip.out_peers("torus", 0, 4, 0)
    with pytest.raises(ValueError, match="average_every"):
        gossip.PushSum("exponential", False, -1, None)
    with pytest.raises(TypeError, match="overlap"):
        gossip.PushSum("exponential", "yes", None, None)
