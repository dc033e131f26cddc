"""SGP's communication graphs: valid peers and column-stochastic mixing for any n."""
import numpy as np
import pytest

from hvd_compress import gossip, p2p


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


@pytest.mark.parametrize("count", [1, 2, 3])
def test_point_to_point_sums_add_in_order_into_buffers_tensorflow_takes_without_a_copy(count):
    """p2p.added: the messages added in order (np.sum's bits), into a 64-byte-aligned buffer (TensorFlow copies
    a numpy_function's result that is not); one message is returned as it is."""
    rng = np.random.default_rng(count)
    arrays = [rng.normal(size=1001).astype(np.float32) for _ in range(count)]
    total = p2p.added(arrays)
    np.testing.assert_array_equal(total, np.sum(arrays, axis=0))
    assert total.dtype == np.float32 and total.shape == (1001,)
    if count == 1:
        assert total is arrays[0]
    else:
        assert total.ctypes.data % p2p.TENSORFLOW_ALIGNMENT == 0
        assert all(total.ctypes.data != a.ctypes.data for a in arrays)  # the messages are left as they were
    buffer = p2p.aligned_empty(np.zeros((3, 5), np.float16))
    assert buffer.shape == (3, 5) and buffer.dtype == np.float16 and buffer.ctypes.data % p2p.TENSORFLOW_ALIGNMENT == 0
