"""ckpt.torch layouts: what Checkpointer records for each tensor item (explicit boxes, flat
ZeRO-1 partitions, replicated state, DTensor and ShardedTensor pieces, optimizer state that
follows its parameter), the errors of layouts that do not fit, and load() at another world
size (resharding, with several ranks of one job in this process, each a Checkpointer with a
client of its own)."""

import gc
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ckpt = pytest.importorskip("ckpt")
import ckpt.torch as ct  # noqa: E402
from rank_processes import LEAVE, run_script_ranks  # noqa: E402


@pytest.fixture(autouse=True)
def _clients_gone_before_daemons_stop(start_daemon):
    yield
    gc.collect()


def sharded_model(rank, world, rows=8):
    """A Linear whose weight rows (and bias) are split over the ranks, plus a replicated head."""
    torch.manual_seed(0)
    per = rows // world
    full = torch.nn.Sequential(torch.nn.Linear(4, rows), torch.nn.Linear(per, 3))
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(full[0].weight.detach()[rank * per:(rank + 1) * per].clone())
    m.b = torch.nn.Parameter(full[0].bias.detach()[rank * per:(rank + 1) * per].clone())
    m.head = full[1]
    layouts = {m.w: ct.Layout(global_shape=[rows, 4], offsets=[rank * per, 0]),
               "model.b": ct.Layout(global_shape=[rows], offsets=[rank * per])}
    return m, layouts


def step(m, opt):
    x = torch.randn(2, 4)
    opt.zero_grad()
    m.head(torch.relu(x @ m.w.T + m.b)).sum().backward()
    opt.step()


def test_boxes_replicated_state_and_optimizer_state_that_follows_its_parameter(daemon):
    m, layouts = sharded_model(1, 2)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    with ct.Checkpointer(daemon.socket, "lay", model=m, optimizer=opt, rank=1, world_size=2,
                         layouts=layouts, replicated=True) as ck:
        step(m, opt)
        ck.save(1)  # registers again with Adam's state
        got = ck.layouts
    assert got["model.w"] == ct.Layout([8, 4], [4, 0], "model.w")
    assert got["model.b"] == ct.Layout([8], [4], "model.b")
    assert got["model.head.weight"] == ct.Layout(replicated=True, global_name="model.head.weight")
    # Adam's state: the parameter's box, under a name of the parameter's global tensor; the
    # step counter (one element) replicated.
    assert got["optim.state.0.exp_avg"] == ct.Layout([8, 4], [4, 0], "optim.state.model.w.exp_avg")
    assert got["optim.state.1.exp_avg_sq"] == ct.Layout([8], [4], "optim.state.model.b.exp_avg_sq")
    assert got["optim.state.0.step"] == ct.Layout(replicated=True, global_name="optim.state.model.w.step")
    assert got["optim.state.2.exp_avg"].replicated
    assert len(got) == 4 + 4 * 3


def test_without_replicated_items_without_a_layout_stay_rank_private(daemon):
    m, layouts = sharded_model(0, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    with ct.Checkpointer(daemon.socket, "priv", model=m, optimizer=opt, rank=0, world_size=2,
                         layouts=layouts) as ck:
        step(m, opt)
        ck.save(1)
        got = ck.layouts
    assert sorted(got) == ["model.b", "model.w", "optim.state.0.momentum_buffer", "optim.state.1.momentum_buffer"]


def test_a_layout_of_the_client_ckpt_layout_is_taken_too(daemon):
    m, _ = sharded_model(1, 2)
    with ct.Checkpointer(daemon.socket, "native", model=m, rank=1, world_size=2,
                         layouts={m.w: ckpt.Layout(global_shape=[8, 4], offsets=[4, 0]),
                                  m.b: ckpt.Layout(global_name="bias", global_shape=[8], offsets=[4])}) as ck:
        assert ck.layouts == {"model.w": ct.Layout([8, 4], [4, 0], "model.w"),
                              "model.b": ct.Layout([8], [4], "bias")}


def test_a_flat_zero_partition_with_a_global_name_of_its_own(daemon):
    # ZeRO-1: each rank's optimizer updates elements [start, start + n) of the flat fp32 master
    # copy of all parameters (here 10 elements split 4 / 3 / 3).
    flat = torch.zeros(3, requires_grad=True)
    opt = torch.optim.Adam([flat], lr=0.1)
    with ct.Checkpointer(daemon.socket, "zero", optimizer=opt, rank=1, world_size=3,
                         layouts={flat: ct.flat_shard(4, 10, "master")}) as ck:
        flat.grad = torch.ones(3)
        opt.step()
        ck.save(1)
        got = ck.layouts
    assert got == {"optim.param.0": ct.Layout([10], [4], "master"),
                   "optim.state.0.step": ct.Layout(replicated=True, global_name="optim.state.master.step"),
                   "optim.state.0.exp_avg": ct.Layout([10], [4], "optim.state.master.exp_avg"),
                   "optim.state.0.exp_avg_sq": ct.Layout([10], [4], "optim.state.master.exp_avg_sq")}


def test_optimizer_state_of_another_shape_stays_rank_private(daemon):
    p = torch.nn.Parameter(torch.zeros(4, 2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p]["row_stats"] = torch.zeros(4)  # factored statistics (Adafactor-like)
    with ct.Checkpointer(daemon.socket, "fact", optimizer=opt, rank=0, world_size=2,
                         layouts={p: ct.Layout([8, 2], [0, 0])}) as ck:
        assert "optim.state.0.row_stats" in ck.tensors()
        assert "optim.state.0.row_stats" not in ck.layouts


@pytest.mark.parametrize("layout, message", [
    (ct.Layout([8, 4], [6, 0]), r"model.w: the box at offsets \[6, 0\] with shape \[4, 4\] does not fit in "
                                r"global_shape \[8, 4\] \(dimension 0: 6 \+ 4 > 8\)"),
    (ct.Layout([8], [0]), r"model.w: the layout has 1 dimensions \(global_shape \[8\]\), the tensor 2"),
    (ct.Layout([5, 3], offsets=[0, 0]), r"dimension 1: 0 \+ 4 > 3"),
])
def test_a_layout_that_does_not_fit_its_tensor_is_a_value_error_naming_it(daemon, layout, message):
    m, _ = sharded_model(0, 2)
    with pytest.raises(ValueError, match=message):
        ct.Checkpointer(daemon.socket, "bad", model=m, rank=0, world_size=2, layouts={m.w: layout})


def test_layouts_that_name_nothing_here_or_are_not_layouts_are_errors(daemon):
    m, _ = sharded_model(0, 2)
    with pytest.raises(ValueError, match=r"layouts: 'model.nope' is not a tensor item of this Checkpointer"):
        ct.Checkpointer(daemon.socket, "bad", model=m, layouts={"model.nope": ct.REPLICATED})
    with pytest.raises(ValueError, match=r"layouts: a tensor of shape \[2\] is not a tensor item"):
        ct.Checkpointer(daemon.socket, "bad", model=m, layouts={torch.zeros(2): ct.REPLICATED})
    with pytest.raises(TypeError, match="must be a ckpt.torch.Layout"):
        ct.Checkpointer(daemon.socket, "bad", model=m, layouts={m.w: (8, 4)})
    with pytest.raises(TypeError, match="a key must be a tensor or an item name, not int"):
        ct.Checkpointer(daemon.socket, "bad", model=m, layouts={3: ct.REPLICATED})


@pytest.mark.parametrize("kwargs, message", [
    ({"global_shape": [4], "offsets": [0, 0]}, "one value per dimension"),
    ({"global_shape": [4], "offsets": [-1]}, "negative"),
    ({"replicated": True, "offsets": [0]}, "a replicated Layout has no offsets"),
    ({"global_shape": [4], "offsets": [0], "global_name": ""}, "non-empty string"),
])
def test_layout_checks_its_own_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ct.Layout(**kwargs)


def _sharded_tensor_module():
    """torch.distributed._shard.sharded_tensor, or a skip saying why this torch has none."""
    try:
        import torch.distributed._shard.sharded_tensor as st
    except Exception as e:  # noqa: BLE001 (torch 1.13 under Python 3.11 fails with ValueError)
        pytest.skip(f"torch {torch.__version__} on Python {sys.version.split()[0]}: "
                    f"torch.distributed._shard does not import ({type(e).__name__}: {str(e)[:120]})")
    return st


@pytest.fixture
def gloo_world_of_one(temp_dir):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch has no torch.distributed with gloo")
    dist.init_process_group("gloo", init_method=f"file://{temp_dir / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_tensor_gives_one_item_per_local_shard_with_its_metadata_box(daemon, gloo_world_of_one):
    st = _sharded_tensor_module()
    from torch.distributed._shard.metadata import ShardMetadata
    shards = [st.Shard(torch.full((2, 4), 1.0), ShardMetadata([0, 0], [2, 4], "rank:0/cpu")),
              st.Shard(torch.full((3, 4), 2.0), ShardMetadata([2, 0], [3, 4], "rank:0/cpu"))]
    m = torch.nn.Module()
    m.register_buffer("table", st.init_from_local_shards(shards, 5, 4))
    with ct.Checkpointer(daemon.socket, "st", model=m) as ck:
        assert ck.layouts == {"model.table[0]": ct.Layout([5, 4], [0, 0], "model.table"),
                              "model.table[1]": ct.Layout([5, 4], [2, 0], "model.table")}
        assert torch.equal(ck.tensors()["model.table[1]"], torch.full((3, 4), 2.0))
        ck.save(1)
        ck.wait_durable()
        stored = ct.load_checkpoint(daemon.root, "st", 1)["tensors"]
    assert torch.equal(stored["model.table[0]"], torch.full((2, 4), 1.0))
    with pytest.raises(ValueError, match="has its own layout"):
        ct.Checkpointer(daemon.socket, "st2", model=m, layouts={"model.table[0]": ct.REPLICATED})


def _dtensor_api():
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no DTensor (torch.distributed.tensor: torch >= 2.4)")
    return DTensor, Replicate, Shard, distribute_tensor, init_device_mesh


def test_dtensor_parameters_give_their_boxes_and_adam_state_follows(daemon, gloo_world_of_one):
    DTensor, Replicate, Shard, distribute_tensor, init_device_mesh = _dtensor_api()
    mesh = init_device_mesh("cpu", (1,))
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(distribute_tensor(torch.arange(12.0).view(3, 4), mesh, [Shard(1)]))
    m.r = torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh, [Replicate()]))
    opt = torch.optim.Adam(m.parameters(), lr=0.1, foreach=False)
    with ct.Checkpointer(daemon.socket, "dt", model=m, optimizer=opt) as ck:
        assert ck.layouts == {"model.w": ct.Layout([3, 4], [0, 0], "model.w"),
                              "model.r": ct.Layout(replicated=True, global_name="model.r")}
        (m.w.sum() + m.r.sum()).backward()
        opt.step()
        ck.save(1)
        got = ck.layouts
        assert got["optim.state.0.exp_avg"] == ct.Layout([3, 4], [0, 0], "optim.state.model.w.exp_avg")
        # The registered tensor is the DTensor's local tensor, moved into shared memory.
        assert ck.tensors()["model.w"] is m.w._local_tensor
        ck.wait_durable()
        stored = ct.load_checkpoint(daemon.root, "dt", 1)["tensors"]
        assert torch.equal(stored["model.w"], m.w._local_tensor)


ROWS = 12


def tp_rank(rank, world):
    """Rank `rank` of `world`: rows [lo, hi) of a 12 x 4 weight and of its bias, a replicated
    vector, Adam, and a generator of its own."""
    torch.manual_seed(0)
    full = torch.nn.Linear(4, ROWS)
    lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(full.weight.detach()[lo:hi].clone())
    m.b = torch.nn.Parameter(full.bias.detach()[lo:hi].clone())
    m.scale = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    layouts = {m.w: ct.Layout([ROWS, 4], [lo, 0]), m.b: ct.Layout([ROWS], [lo])}
    return m, opt, layouts, (lo, hi)


def save_4_ranks(daemon, job, replicated=True):
    """Saves version 1 of `job` with 4 ranks; returns the global tensors and each rank's RNG
    and generator states."""
    ranks = [tp_rank(r, 4) for r in range(4)]
    gens = [torch.Generator().manual_seed(50 + r) for r in range(4)]
    cks = [ct.Checkpointer(daemon.socket, job, rank=r, world_size=4, model=m, optimizer=opt, layouts=lay,
                           replicated=replicated, extra_state={"samples_seen": 96, "written_by": r}, gen=gens[r])
           for r, (m, opt, lay, _) in enumerate(ranks)]
    for r, (m, opt, _, _) in enumerate(ranks):
        (m.w.sum() * (r + 1) + m.b.sum() + m.scale.sum()).backward()
        opt.step()
    rng = []
    for r, ck in enumerate(cks):
        torch.manual_seed(100 + r)  # each rank's own torch stream (the ranks share this process)
        rng.append(torch.get_rng_state())
        ck.save(1)
    for ck in cks:  # each rank seals its shard (a version commits once every rank has)
        ck.wait_snapshot()
    for ck in cks:
        ck.wait_durable(1, timeout=60)
        ck.close()
    # The version's index: the global tensors, each rank's chunk, rank 0's blob for every rank.
    index = json.loads((Path(daemon.root) / job / "v0000000001" / "index.json").read_text())
    assert index["world_size"] == 4
    assert [c["offsets"] for c in index["tensors"]["model.w"]["chunks"]] == [[0, 0], [3, 0], [6, 0], [9, 0]]
    assert index["tensors"]["optim.state.model.w.exp_avg"]["shape"] == [ROWS, 4]
    assert [(b["rank"], b["for_rank"]) for b in index["blobs"]] == [(0, None), (1, 1), (2, 2), (3, 3)]
    glob = {"w": torch.cat([m.w.detach() for m, _, _, _ in ranks]),
            "b": torch.cat([m.b.detach() for m, _, _, _ in ranks]),
            "w.exp_avg": torch.cat([opt.state[m.w]["exp_avg"] for m, opt, _, _ in ranks]),
            "b.exp_avg_sq": torch.cat([opt.state[m.b]["exp_avg_sq"] for m, opt, _, _ in ranks]),
            "scale": ranks[0][0].scale.detach().clone()}
    return glob, rng, [g.get_state() for g in gens]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_load_at_another_world_size_reshards_and_follows_the_blob_rules(daemon, world):
    glob, rng, gen_states = save_4_ranks(daemon, f"re{world}")
    ranks = []
    for r in range(world):
        m, opt, layouts, (lo, hi) = tp_rank(r, world)
        data, gen = {}, torch.Generator()
        torch.manual_seed(7)  # what a new rank starts with
        ck = ct.Checkpointer(daemon.socket, f"re{world}", rank=r, world_size=world, model=m, optimizer=opt,
                             layouts=layouts, replicated=True, extra_state=data, gen=gen)
        ranks.append((ck, m, opt))
        assert ck.load("latest") == 1
        assert (ck.restored_world_size, ck.resharded) == (4, True)
        assert torch.equal(m.w.detach(), glob["w"][lo:hi]) and torch.equal(m.b.detach(), glob["b"][lo:hi])
        assert torch.equal(opt.state[m.w]["exp_avg"], glob["w.exp_avg"][lo:hi])
        assert torch.equal(opt.state[m.b]["exp_avg_sq"], glob["b.exp_avg_sq"][lo:hi])
        assert torch.equal(m.scale.detach(), glob["scale"])
        assert float(opt.state[m.w]["step"]) == 1.0
        # Job state from old rank 0; per-rank state from old rank r (old rank 0 for a new rank).
        assert data == {"samples_seen": 96, "written_by": 0}
        old = r if r < 4 else 0
        assert torch.equal(torch.get_rng_state(), rng[old]), f"rank {r}: not old rank {old}'s torch RNG"
        assert torch.equal(gen.get_state(), gen_states[old])
    # Training goes on at the new world size.
    for ck, m, opt in ranks:
        (m.w.sum() + m.b.sum()).backward()
        opt.step()
        ck.save(2)
    for ck, _, _ in ranks:  # each rank seals its shard first
        ck.wait_snapshot()
    for ck, _, _ in ranks:
        ck.wait_durable(2, timeout=60)
        ck.close()
    listed = json.loads(daemon.ctl("ls", "--job", f"re{world}", "--json").stdout)
    assert listed["latest"] == 2
    assert next(v for v in listed["versions"] if v["version"] == 2)["durable_ranks"] == list(range(world))


def test_a_resharding_load_refuses_rank_private_items_and_other_shapes_before_restoring(daemon):
    save_4_ranks(daemon, "priv4", replicated=False)  # scale and its Adam state: rank-private
    m, opt, layouts, _ = tp_rank(0, 2)
    with ct.Checkpointer(daemon.socket, "priv4", rank=0, world_size=2, model=m, optimizer=opt,
                         layouts=layouts) as ck:
        with pytest.raises(ct.StateMismatchError) as e:
            ck.load("latest")
    msg = str(e.value)
    assert "version 1 of job 'priv4' (written by 4 ranks; this is rank 0 of 2)" in msg
    assert "model.scale is rank-private (no layout)" in msg
    assert "the checkpoint has rank-private items (model.scale of rank 0" in msg
    assert torch.equal(m.w.detach(), tp_rank(0, 2)[0].w.detach())  # nothing restored

    # Another global shape: 16 rows here, 12 in the checkpoint.
    save_4_ranks(daemon, "shape4")
    m, opt, _, _ = tp_rank(0, 2)
    with ct.Checkpointer(daemon.socket, "shape4", rank=0, world_size=2, model=m, optimizer=opt, replicated=True,
                         layouts={m.w: ct.Layout([16, 4], [0, 0]), m.b: ct.Layout([16], [0])}) as ck:
        with pytest.raises(ct.StateMismatchError, match=r"model.w is F32 \[16, 4\] here but F32 \[12, 4\] in the "
                                                        r"checkpoint"):
            ck.load("latest")


FSDP2_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import ckpt.torch as ct
rank, world, port, job, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=world)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))  # 7 rows: uneven shards
fully_shard(m)
opt = torch.optim.Adam(m.parameters(), lr=0.1)
def step(seed):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    m(x).sum().backward()
    opt.step()
out = {}
if mode == "resume":
    ck = ct.Checkpointer(None, job, model=m, optimizer=opt)
    out["step"] = ck.load("latest")
    out["resharded"] = ck.resharded
else:
    step(0)  # FSDP2's lazy init has run: the Checkpointer comes after it
    ck = ct.Checkpointer(None, job, model=m, optimizer=opt) if mode == "ckpt" else None
    for s in range(1, 4):
        step(s)
        if ck:
            ck.save(s)
    if ck:
        ck.wait_durable(timeout=60)
        out["layouts"] = {k: [list(v.global_shape), list(v.offsets)] for k, v in ck.layouts.items()
                          if k.startswith("model.0.")}
        out["saved_local"] = m[0].weight._local_tensor.tolist()
full = {k: v.full_tensor() for k, v in m.state_dict().items()}
full.update({f"{k}.exp_avg": opt.state[p]["exp_avg"].full_tensor() for k, p in m.named_parameters()})
if ck:
    ck.close()
out["full"] = {k: v.tolist() for k, v in full.items()}
print("RESULT " + json.dumps(out), flush=True)
""" + LEAVE


HSDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
import ckpt.torch as ct
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (2, 1))
m = torch.nn.Module()
m.w = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Replicate(), Shard(0)]))
try:
    ct.Checkpointer(None, "hsdp", model=m)
except ct.UnsupportedTensorError as e:
    print("RESULT " + json.dumps(str(e)), flush=True)
""".replace("import sys,", "import json, sys,") + LEAVE


def run_ranks(daemon, world, *args, script=None):
    return run_script_ranks(daemon, world, script or FSDP2_SCRIPT, *args)


def _fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard: torch >= 2.6)")
    except Exception as e:  # noqa: BLE001 (torch 1.13 under Python 3.11: its FSDP imports _shard, which fails)
        pytest.skip(f"torch {torch.__version__}: torch.distributed.fsdp does not import ({type(e).__name__}: "
                    f"{str(e)[:100]})")


def test_fsdp2_trains_as_without_ckpt_and_saves_each_ranks_shard_with_its_box(daemon):
    _fsdp2()
    plain = run_ranks(daemon, 2, "fsdp-plain", "plain")
    with_ckpt = run_ranks(daemon, 2, "fsdp", "ckpt")
    # Registering FSDP2's shards (copies refreshed by save: FSDP2 all-gathers from its own
    # padded buffer, which must stay where it is) changes nothing in the training.
    assert with_ckpt[0]["full"] == plain[0]["full"]
    assert with_ckpt[0]["layouts"] == {"model.0.weight": [[7, 5], [0, 0]], "model.0.bias": [[7], [0]]}
    assert with_ckpt[1]["layouts"] == {"model.0.weight": [[7, 5], [4, 0]], "model.0.bias": [[7], [4]]}
    for r in range(2):
        stored = ct.load_checkpoint(daemon.root, "fsdp", 3, rank=r)["tensors"]["model.0.weight"]
        assert stored.tolist() == with_ckpt[r]["saved_local"]
    # 2 fresh ranks resume it: the same state, Adam's moments (DTensors too) included.
    for r in run_ranks(daemon, 2, "fsdp", "resume"):
        assert r["step"] == 3 and not r["resharded"]
        assert r["full"] == with_ckpt[0]["full"]


def test_fsdp2_state_of_2_ranks_resumes_on_1_and_on_3(daemon):
    _fsdp2()
    saved = run_ranks(daemon, 2, "fsdp-re", "ckpt")[0]["full"]
    for world in (1, 3):
        resumed = run_ranks(daemon, world, "fsdp-re", "resume")
        for r in resumed:
            assert r["step"] == 3 and r["resharded"]
            assert r["full"] == saved


def test_a_dtensor_replicated_over_part_of_its_mesh_is_refused_naming_it(daemon):
    _dtensor_api()
    for message in run_ranks(daemon, 2, script=HSDP_SCRIPT):
        assert message.startswith("model.w: a DTensor sharded over some mesh dimensions and replicated over "
                                  "others"), message
        assert "each piece of a global tensor must be held by one rank" in message


def test_load_at_the_same_world_size_with_other_boxes_reshards_too(daemon):
    glob, _, _ = save_4_ranks(daemon, "swap")
    ranks = []
    for r in range(4):
        m, opt, layouts, (lo, hi) = tp_rank(3 - r, 4)  # rank r holds the rows old rank 3 - r held
        ck = ct.Checkpointer(daemon.socket, "swap", rank=r, world_size=4, model=m, optimizer=opt,
                             layouts=layouts, replicated=True, extra_state={})
        ranks.append(ck)
        assert ck.load("latest") == 1
        assert (ck.restored_world_size, ck.resharded) == (4, True)
        assert torch.equal(m.w.detach(), glob["w"][lo:hi])
        assert torch.equal(opt.state[m.w]["exp_avg"], glob["w.exp_avg"][lo:hi])
    for ck in ranks:
        ck.close()


def test_a_resharding_load_names_optimizer_state_whose_parameter_has_no_layout_here(daemon):
    save_4_ranks(daemon, "orphan4")  # scale replicated there
    m, opt, layouts, _ = tp_rank(1, 2)
    with ct.Checkpointer(daemon.socket, "orphan4", rank=1, world_size=2, model=m, optimizer=opt,
                         layouts=layouts) as ck:  # no replicated=True: scale is rank-private here
        with pytest.raises(ct.StateMismatchError) as e:
            ck.load("latest")
    msg = str(e.value)
    assert "model.scale is rank-private (no layout)" in msg
    assert ("the checkpoint has optimizer state of no parameter with a layout here: optim.state.model.scale.exp_avg, "
            "optim.state.model.scale.exp_avg_sq, optim.state.model.scale.step") in msg
