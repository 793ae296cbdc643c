"""The GPU the plans are made for (`xkern.device`): read from the driver on a GPU, the H100/H200's values without
one; plans for each architecture fit its shared memory, and on the H100/H200 they are the fixed tiles as before."""

import pytest
from helpers import GPU

from xkern import device
from xkern import grouped_mm as gmm
from xkern.launch import FLOATS, ITEMSIZE
from xkern.rms_norm import plan_rms_norm_bwd, plan_rms_norm_fwd


def test_properties_are_the_devices_or_the_h100s():
    """Without a GPU (or under the interpreter) the H100/H200's values; on a GPU, device 0's as the driver gives
    them, which torch's own query must match (and, on an H100 or H200, the plans' former constants)."""
    props = device.properties()
    if not GPU:
        assert props == device.H100 == device.DeviceProperties(90, 132, 232_448)
        return
    torch = pytest.importorskip("torch")
    p = torch.cuda.get_device_properties(0)
    queried = device._query_cuda(0)
    assert queried == device.DeviceProperties(10 * p.major + p.minor, p.multi_processor_count,
                                              p.shared_memory_per_block_optin)
    if "H100" in p.name or "H200" in p.name:
        assert queried == device.H100, (p.name, queried)


def test_target_plans_for_another_gpu_and_restores():
    """Inside `target` the plans read its properties (grids by its SM count, GEMM stages by its shared memory),
    cached recipes rebuilt on the way in and out."""
    before = gmm.grouped_mm_recipe(4096, 256, 512, 8, "bfloat16", 256, (256 * 512, 512, 1))
    bwd = plan_rms_norm_bwd(100_000, 4096, 1e-6)  # a few programs per SM
    with device.target(device.ARCHITECTURES[86]) as props:
        assert device.properties() is props
        inside = gmm.grouped_mm_recipe(4096, 256, 512, 8, "bfloat16", 256, (256 * 512, 512, 1))
        assert inside.steps[0].launch.num_stages == 3
        assert plan_rms_norm_fwd(10_000, 70_000, 1e-6).grid == (84,)  # a program per SM: the A40's 84
        assert plan_rms_norm_bwd(100_000, 4096, 1e-6).n_partials * device.H100.num_sms == \
            bwd.n_partials * 84 or GPU  # as many programs per SM (on a GPU, bwd has the GPU's)
    assert before.steps[0].launch.num_stages == 4
    assert gmm.grouped_mm_recipe(4096, 256, 512, 8, "bfloat16", 256, (256 * 512, 512, 1)) == before
    assert plan_rms_norm_bwd(100_000, 4096, 1e-6) == bwd


@pytest.mark.parametrize("arch", sorted(device.ARCHITECTURES))
def test_gemm_tiles_fit_each_architecture(arch):
    """Every tile the grouped GEMM's plans choose fits the architecture's shared memory by the plans' own bound
    (the compile check holds the binaries to it); on sm_90 (H100, H200) and sm_100 the fixed tiles as they
    are, on the 99 KiB parts the rows kernel's 4 stages cut to 3."""
    props = device.ARCHITECTURES[arch]
    with device.target(props):
        tiles = [(gmm.rows_tile(d, k), ITEMSIZE[d]) for d in FLOATS for k in (256, 8192)]
        tiles += [(gmm.dw_tile(d), ITEMSIZE[d]) for d in FLOATS]
        assert all(gmm.pipeline_bytes(t, size, arch) <= props.max_shared_mem for t, size in tiles)
        rows = gmm.rows_tile("bfloat16", 256)
    if props.max_shared_mem >= 200 * 1024:
        assert rows == gmm.ROWS_TILES[2] and gmm.fit(gmm.DW_TILES[2], 2) == gmm.DW_TILES[2]
    elif props.max_shared_mem < 100 * 1024:
        assert rows == gmm.ROWS_TILES[2]._replace(num_stages=3)
