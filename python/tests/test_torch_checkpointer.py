"""ckpt.torch.Checkpointer against a real ckptd: tensors moved into shared memory once, lazy
optimizer state, the automatic wait before the update, in-place restore (also into fresh
objects, as after a restart), rollback, the daemon-less loader, and clear errors on bad use.

Uses conftest's `daemon` fixture (a ckptd on a fresh root and socket)."""

import gc
import pickle
import random
import re
import time
import urllib.request
import warnings

import pytest

torch = pytest.importorskip("torch")
ckpt = pytest.importorskip("ckpt")
import ckpt.torch as ct  # noqa: E402


@pytest.fixture(autouse=True)
def _clients_gone_before_daemons_stop(start_daemon):
    """A ckptd asked to stop waits (5 s) for connected clients; tests drop theirs first.
    (Set up after start_daemon, so torn down before it stops the daemons.)"""
    yield
    gc.collect()


class Counter:
    """Some object of the trainer with state_dict()/load_state_dict()."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def make(seed=0, hidden=8, scheduler=True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.LayerNorm(hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[3].weight], "weight_decay": 0.1},
                             {"params": [model[0].bias, model[1].weight, model[1].bias, model[3].bias],
                              "weight_decay": 0.0}], lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if scheduler else None
    return model, opt, sched


def train_step(model, opt, sched, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g)
    loss = (model(x) + 0.01 * torch.randn(16, 2)).pow(2).mean()  # the global RNG matters too
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if sched is not None:
        sched.step()
    return loss.item()


def state_of(model, opt):
    """Clones of every tensor that is checkpointed, by item name, plus the optimizer's groups."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            out[f"optim.state.{i}.{k}"] = v.clone() if torch.is_tensor(v) else v
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def in_regions(ck, t):
    return any(r.address <= t.data_ptr() < r.address + r.size for r in ck._regions)


def test_setup_moves_state_into_shared_memory_keeping_identity(daemon):
    model, opt, sched = make()
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ct.Checkpointer(daemon.socket, "identity", model=model, optimizer=opt, scheduler=sched) as ck:
        assert [p for p in model.parameters()] == params and all(a is b for a, b in zip(model.parameters(), params))
        assert all(p is q for p, q in zip([p for g in opt.param_groups for p in g["params"]],
                                          [model[0].weight, model[3].weight, model[0].bias, model[1].weight,
                                           model[1].bias, model[3].bias]))
        assert all(in_regions(ck, p) for p in params)
        assert_same({k: v for k, v in model.state_dict().items()}, before)
        assert [n for n, _, _ in ck.items] == [f"model.{k}" for k in before]
        assert ck.registration.item_count == len(before)

        # AdamW's state appears at the first step: the next save moves it and registers again.
        train_step(model, opt, sched, 1)
        ck.save(1)
        names = [n for n, _, _ in ck.items]
        assert len(names) == len(before) + 3 * len(params), names
        assert ck.registration.item_count == len(names)
        for p in params:
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert in_regions(ck, opt.state[p][k]), k
        regions = len(ck._regions)
        for step in range(2, 5):  # nothing new: no more regions, no re-registration
            train_step(model, opt, sched, step)
            ck.save(step)
        assert len(ck._regions) == regions
        ck.wait_durable()
        shard = ckpt.load_version(daemon.root, "identity", 4, rank=0)
        for name, t in state_of(model, opt).items():
            if name != "groups":
                assert torch.equal(shard.tensors[name], t), name


def test_the_wait_before_the_update_is_automatic(daemon):
    model, opt, _ = make(scheduler=False)
    ck = ct.Checkpointer(daemon.socket, "auto-wait", model=model, optimizer=opt)
    # A scheduler created after the Checkpointer wraps optimizer.step again (torch 1.x): it
    # must neither warn nor lose the wait.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        for step in range(1, 4):
            train_step(model, opt, sched, step)
            ck.save(step)
            assert ck.pending == step
            model(torch.zeros(1, 4))  # forward does not wait ...
            assert ck.pending == step
            opt.step()  # ... the update does
            assert ck.pending is None
    assert ck.total_stall_s >= 0
    ck.close()
    ck._pending = 1  # even with a version pending, a closed Checkpointer no longer waits
    opt.step()


def test_save_then_load_restores_everything_in_place_and_rolls_back(daemon):
    model, opt, sched = make()
    data = {"epoch": 0, "position": 0}
    counter = Counter()
    ck = ct.Checkpointer(daemon.socket, "inplace", model=model, optimizer=opt, scheduler=sched,
                         extra_state=data, counter=counter)
    snaps = {}
    for step in range(1, 5):
        train_step(model, opt, sched, step)
        counter.n += 1
        data["position"] += 16
        ck.save(step)
        snaps[step] = (state_of(model, opt), sched.state_dict(), dict(data), counter.state_dict(),
                       torch.get_rng_state().clone(), random.getstate())
    ck.wait_durable()
    objects = list(model.parameters())
    assert ck.load("latest") == 4
    assert_same(state_of(model, opt), snaps[4][0])
    assert ck.load(2) == 2  # a rollback: version 3 and 4 are set aside
    st, sched_sd, data_sd, counter_sd, rng, pyrng = snaps[2]
    assert_same(state_of(model, opt), st)
    assert sched.state_dict() == sched_sd and data == data_sd and counter.state_dict() == counter_sd
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == pyrng
    assert all(a is b for a, b in zip(model.parameters(), objects))
    assert all(in_regions(ck, p) for p in objects)
    # Training goes on from step 2: step 3 again gives the loss it gave the first time.
    torch.set_rng_state(rng)
    loss3 = train_step(model, opt, sched, 3)
    ck.save(3)
    assert_same(state_of(model, opt), snaps[3][0])
    ck.wait_durable()
    assert ckpt.list_versions(daemon.root, "inplace") == [1, 2, 3]
    assert isinstance(loss3, float)
    ck.close()


def test_fresh_objects_resume_bit_exact(daemon):
    """What a restarted trainer does: new objects (other initial values, no optimizer state),
    load('latest'), continue: the same numbers as the run that never stopped."""
    model, opt, sched = make(seed=0)
    ck = ct.Checkpointer(daemon.socket, "fresh", model=model, optimizer=opt, scheduler=sched)
    for step in range(1, 4):
        train_step(model, opt, sched, 100 + step)
        ck.save(step)
    ck.wait_durable()
    ck.close()
    rng = torch.get_rng_state()
    reference = [train_step(model, opt, sched, 100 + step) for step in range(4, 7)]
    expected = state_of(model, opt)

    model2, opt2, sched2 = make(seed=1)
    assert not opt2.state
    ck2 = ct.Checkpointer(daemon.socket, "fresh", model=model2, optimizer=opt2, scheduler=sched2)
    torch.manual_seed(12345)  # the restore must bring the RNG back
    assert ck2.load("latest") == 3
    assert torch.equal(torch.get_rng_state(), rng)
    for p in opt2.param_groups[0]["params"]:
        assert in_regions(ck2, opt2.state[p]["exp_avg"])
    resumed = [train_step(model2, opt2, sched2, 100 + step) for step in range(4, 7)]
    assert [x.hex() for x in resumed] == [x.hex() for x in reference]
    assert_same(state_of(model2, opt2), expected)
    ck2.close()


def test_tied_weights_are_one_item(daemon):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(3)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = ct.Checkpointer(daemon.socket, "tied", model=model, optimizer=opt)
    assert [n for n, _, _ in ck.items] == ["model.emb.weight"]
    assert model.head.weight is model.emb.weight
    loss = model.head(model.emb(torch.tensor([1, 2, 3]))).sum()
    loss.backward()
    opt.step()
    ck.save(1)
    ck.wait_durable()
    saved = model.emb.weight.detach().clone()
    with torch.no_grad():
        model.emb.weight.zero_()
    ck.load(1)
    assert torch.equal(model.head.weight, saved) and model.head.weight is model.emb.weight
    ck.close()
    loaded = ct.load_checkpoint(daemon.root, "tied")
    assert loaded["model"].keys() == {"emb.weight", "head.weight"}
    assert torch.equal(loaded["model"]["head.weight"], saved)


def test_load_checkpoint_without_daemon(daemon):
    model, opt, sched = make()
    data = {"position": 7}
    ck = ct.Checkpointer(daemon.socket, "offline", model=model, optimizer=opt, scheduler=sched, extra_state=data)
    for step in range(1, 3):
        train_step(model, opt, sched, step)
        data["position"] += 1
        ck.save(step)
    ck.wait_durable()
    ck.close()
    expected = state_of(model, opt)
    del ck
    gc.collect()  # no client left: the daemon stops at once
    assert daemon.stop() == 0

    loaded = ct.load_checkpoint(daemon.root, "offline")
    assert loaded["step"] == 2 and loaded["extra_state"] == {"position": 9}
    model2, opt2, sched2 = make(seed=5)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    assert_same(state_of(model2, opt2), expected)
    assert sched2.state_dict() == sched.state_dict()
    assert ct.load_checkpoint(daemon.root, "offline", 1)["step"] == 1
    with pytest.raises(ckpt.VersionNotFoundError):
        ct.load_checkpoint(daemon.root, "offline", 9)


# -- bad use -----------------------------------------------------------------------------


def test_non_contiguous_tensor_is_refused(daemon):
    model, opt, _ = make(scheduler=False)
    model[0].weight.data = model[0].weight.data.t().contiguous().t()  # same shape, transposed strides
    with pytest.raises(ct.UnsupportedTensorError, match=r"model\.0\.weight: tensor is not contiguous"):
        ct.Checkpointer(daemon.socket, "noncontig", model=model, optimizer=opt)


def test_non_contiguous_state_appearing_later_is_refused_at_save(daemon):
    model, opt, _ = make(scheduler=False)
    ck = ct.Checkpointer(daemon.socket, "noncontig2", model=model, optimizer=opt)
    p = model[0].weight
    opt.state[p]["extra"] = torch.zeros(8, 4).t()
    with pytest.raises(ct.UnsupportedTensorError, match=r"optim\.state\.0\.extra: tensor is not contiguous"):
        ck.save(1)
    ck.close()


def test_tensor_on_unsupported_device_is_refused(daemon):
    model = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ct.UnsupportedTensorError, match=r"model\.weight: tensor on device 'meta' is not supported"):
        ct.Checkpointer(daemon.socket, "meta", model=model)


def test_unsupported_dtype_and_shared_storage_are_refused(daemon):
    class Odd(torch.nn.Module):
        def __init__(self, buf):
            super().__init__()
            self.register_buffer("z", buf)

    with pytest.raises(ct.UnsupportedTensorError, match=r"model\.z: dtype torch\.complex64"):
        ct.Checkpointer(daemon.socket, "complex", model=Odd(torch.zeros(3, dtype=torch.complex64)))
    flat = torch.zeros(8)
    shared = torch.nn.Module()
    shared.register_buffer("a", flat[:4])
    shared.register_buffer("b", flat[4:])
    with pytest.raises(ct.UnsupportedTensorError, match="share memory"):
        ct.Checkpointer(daemon.socket, "shared", model=shared)


def test_loading_a_version_that_does_not_exist(daemon):
    model, opt, _ = make(scheduler=False)
    ck = ct.Checkpointer(daemon.socket, "missing", model=model, optimizer=opt)
    with pytest.raises(ckpt.VersionNotFoundError, match="job 'missing' has no committed version"):
        ck.load("latest")
    train_step(model, opt, None, 1)
    ck.save(1)
    ck.wait_durable()
    with pytest.raises(ckpt.VersionNotFoundError, match=r"version 7 of job 'missing'.*newest committed: 1"):
        ck.load(7)
    with pytest.raises(ValueError, match="positive int"):
        ck.load(0)
    assert ck.load("latest") == 1
    ck.close()


def test_state_whose_shapes_do_not_match_the_checkpoint(daemon):
    model, opt, _ = make(hidden=8, scheduler=False)
    ck = ct.Checkpointer(daemon.socket, "shapes", model=model, optimizer=opt)
    train_step(model, opt, None, 1)
    ck.save(1)
    ck.wait_durable()
    ck.close()
    model2, opt2, _ = make(hidden=16, scheduler=False)
    ck2 = ct.Checkpointer(daemon.socket, "shapes", model=model2, optimizer=opt2)
    with pytest.raises(ct.StateMismatchError, match=r"model\.0\.weight is F32 \[16, 4\] here but F32 \[8, 4\] "
                                                    r"in the checkpoint"):
        ck2.load("latest")
    ck2.close()
    # A model with an extra layer: named too.
    model3 = torch.nn.Sequential(*make(hidden=8)[0], torch.nn.Linear(2, 2))
    ck3 = ct.Checkpointer(daemon.socket, "shapes", model=model3)
    with pytest.raises(ct.StateMismatchError, match=r"model\.4\.weight \(F32 \[2, 2\]\) is not in the checkpoint"):
        ck3.load(1)
    ck3.close()


def test_blob_is_plain_pickle_of_the_non_tensor_state(daemon):
    model, opt, sched = make()
    ck = ct.Checkpointer(daemon.socket, "blob", model=model, optimizer=opt, scheduler=sched, extra_state={"k": 1})
    train_step(model, opt, sched, 1)
    ck.save(1)
    ck.wait_durable()
    ck.close()
    shard = ckpt.load_version(daemon.root, "blob", 1, rank=0)
    state = pickle.loads(shard.blobs[ct.BLOB])
    assert state["step"] == 1 and state["extra_state"] == {"k": 1}
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.1, 0.0]
    assert state["scheduler"]["last_epoch"] == 1
    assert {"python", "torch"} <= set(state["rng"])


def test_batchnorm_statistics_are_staged_so_the_forward_need_not_wait(daemon):
    """The running statistics a forward changes are registered through a staging copy that
    save() refreshes: the forward after save() runs at once, the version still holds the
    statistics of the save, and a load puts them back into the model's own buffers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = ct.Checkpointer(daemon.socket, "batchnorm", model=model, optimizer=opt)
    assert ck.wait_before == "step"
    bn = model[1]
    buffers = [bn.running_mean, bn.running_var, bn.num_batches_tracked]
    assert "model.1.running_mean" in ck.tensors() and ck.tensors()["model.1.running_mean"] is bn.running_mean
    train_step(model, opt, None, 1)
    ck.save(1)
    saved = [b.clone() for b in buffers]
    model(torch.randn(16, 4))  # changes the statistics while version 1 may still be copied
    assert ck.pending == 1 and not torch.equal(bn.running_mean, saved[0])
    opt.step()  # the update waits
    assert ck.pending is None
    ck.wait_durable()
    shard = ckpt.load_version(daemon.root, "batchnorm", 1, rank=0)
    for name, want in zip(("running_mean", "running_var", "num_batches_tracked"), saved):
        assert torch.equal(shard.tensors[f"model.1.{name}"], want), name
    assert ck.load(1) == 1
    assert [b is c for b, c in zip(buffers, [bn.running_mean, bn.running_var, bn.num_batches_tracked])] == [True] * 3
    for b, want in zip(buffers, saved):
        assert torch.equal(b, want)
    ck.close()
    # Asked for, the wait before every forward is still there.
    ck2 = ct.Checkpointer(daemon.socket, "batchnorm", model=model, optimizer=opt, wait_before="forward")
    train_step(model, opt, None, 2)
    ck2.save(2)
    model(torch.randn(16, 4))
    assert ck2.pending is None
    ck2.close()


def test_two_ranks_commit_together_and_each_restores_its_own_shard(daemon):
    ranks = []
    for rank in range(2):
        model, opt, sched = make(seed=rank)
        ranks.append((model, opt, sched, ct.Checkpointer(daemon.socket, "two-ranks", rank=rank, world_size=2,
                                                         model=model, optimizer=opt, scheduler=sched)))
    for model, opt, sched, ck in ranks:
        train_step(model, opt, sched, 1)
        ck.save(1)
    for _, _, _, ck in ranks:  # each rank seals its shard (its next update would)
        ck.wait_snapshot()
    ranks[0][3].wait_durable(1, ckpt.Level.COMMITTED, timeout=60)
    expected = [state_of(model, opt) for model, opt, _, _ in ranks]
    for model, opt, sched, ck in ranks:
        train_step(model, opt, sched, 2)  # not saved
    for (model, opt, _, ck), want in zip(ranks, expected):
        assert ck.load("latest") == 1
        assert_same(state_of(model, opt), want)
        ck.close()


# -- what save() pickles, generators, the worker thread -----------------------------------


def make_one_cycle(seed=0, total_steps=20):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total_steps)
    return model, opt, sched


def test_one_cycle_lr_is_saved_without_its_optimizer_and_resumes_bit_exact(daemon):
    """torch 1.x's OneCycleLR has anneal_func = self._annealing_cos in its state_dict(): pickled,
    it dragged the scheduler, the optimizer and every parameter into each blob, and its load
    bound the live scheduler's anneal_func to an unpickled copy."""
    model, opt, sched = make_one_cycle()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in particular no warning about a large blob
        ck = ct.Checkpointer(daemon.socket, "one-cycle", model=model, optimizer=opt, scheduler=sched)
        for step in range(1, 4):
            train_step(model, opt, sched, step)
            ck.save(step)
        ck.wait_durable()
    ck.close()
    blob = ckpt.load_version(daemon.root, "one-cycle", 3, rank=0).blobs[ct.BLOB]
    state = pickle.loads(blob)
    assert "anneal_func" not in state["scheduler"] and state["scheduler"]["last_epoch"] == 3
    assert b"_rebuild_tensor" not in blob and b"SGD" not in blob, "the blob pickles tensors or the optimizer"
    rng = torch.get_rng_state()
    reference = [(train_step(model, opt, sched, step), sched.get_last_lr()) for step in range(4, 8)]

    model2, opt2, sched2 = make_one_cycle(seed=1, total_steps=20)
    ck2 = ct.Checkpointer(daemon.socket, "one-cycle", model=model2, optimizer=opt2, scheduler=sched2)
    assert ck2.load("latest") == 3
    if hasattr(sched2, "anneal_func"):  # torch 1.x: the live scheduler's own method
        assert sched2.anneal_func.__self__ is sched2
    assert torch.equal(torch.get_rng_state(), rng)
    resumed = [(train_step(model2, opt2, sched2, step), sched2.get_last_lr()) for step in range(4, 8)]
    assert [(x.hex(), lr) for x, lr in resumed] == [(x.hex(), lr) for x, lr in reference]
    assert_same(state_of(model2, opt2), state_of(model, opt))
    ck2.close()
    # The daemon-less loader gives a state dict that load_state_dict takes as it is.
    sched3 = make_one_cycle(seed=2)[2]
    sched3.load_state_dict(ct.load_checkpoint(daemon.root, "one-cycle", 3)["scheduler"])
    assert sched3.last_epoch == 3
    if hasattr(sched3, "anneal_func"):  # torch 1.x; torch 2.x keeps only the strategy's name
        assert sched3.anneal_func.__self__ is sched3


def test_generators_passed_as_objects_are_saved_and_restored(daemon):
    """A torch.Generator of the trainer's own (here a RandomSampler's) is saved with its state
    and restored by load: the resumed run draws the same sample order."""
    model, opt, _ = make(scheduler=False)
    g = torch.Generator().manual_seed(7)
    sampler = torch.utils.data.RandomSampler(range(50), generator=g)
    ck = ct.Checkpointer(daemon.socket, "generator", model=model, optimizer=opt, sampler=g)
    assert ck.generators == {"sampler": g} and ck.objects == {}
    for epoch in range(1, 4):
        for i in list(sampler)[:3]:
            train_step(model, opt, None, i)
        ck.save(epoch)
    ck.wait_durable()
    ck.close()
    saved = g.get_state()
    reference = [list(sampler) for _ in range(3)]

    g2 = torch.Generator().manual_seed(99)
    sampler2 = torch.utils.data.RandomSampler(range(50), generator=g2)
    model2, opt2, _ = make(seed=3, scheduler=False)
    ck2 = ct.Checkpointer(daemon.socket, "generator", model=model2, optimizer=opt2, sampler=g2)
    assert ck2.load("latest") == 3
    assert torch.equal(g2.get_state(), saved)
    assert [list(sampler2) for _ in range(3)] == reference
    ck2.close()
    loaded = ct.load_checkpoint(daemon.root, "generator", 3)["generators"]
    assert torch.equal(loaded["sampler"], saved)
    g3 = torch.Generator()
    g3.set_state(loaded["sampler"])
    assert list(torch.utils.data.RandomSampler(range(50), generator=g3)) == reference[0]


class Cache:
    """An object whose state_dict() returns a tensor: 160 KB pickled at every save."""

    def state_dict(self):
        return {"n": 1, "table": torch.zeros(40000)}

    def load_state_dict(self, sd):
        pass


def test_a_large_pickled_state_warns_once_naming_it(daemon):
    model, opt, sched = make()
    ck = ct.Checkpointer(daemon.socket, "large", model=model, optimizer=opt, scheduler=sched, cache=Cache())
    train_step(model, opt, sched, 1)
    with pytest.warns(RuntimeWarning, match=r"the state of object 'cache' \(Cache\) pickles to 15\d KiB at every "
                                            r"save \(warn_blob_bytes=65536\): \['table'\] 15\d KiB \(holds 1 tensor\)"):
        ck.save(1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2, 4):
            train_step(model, opt, sched, step)
            ck.save(step)
    assert [str(w.message) for w in seen] == []
    ck.close()
    quiet = ct.Checkpointer(daemon.socket, "large", model=model, optimizer=opt, cache=Cache(), warn_blob_bytes=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.save(4)
    quiet.close()


def test_errors_of_the_worker_threads_snapshot_come_with_the_next_wait(daemon):
    model, opt, _ = make(scheduler=False)
    ck = ct.Checkpointer(daemon.socket, "worker-errors", model=model, optimizer=opt)
    train_step(model, opt, None, 1)
    ck.save(5)  # the first save after the registration: sent by save() itself
    assert ck._job is None
    train_step(model, opt, None, 2)
    ck.save(3)  # sent by the worker thread, refused by the daemon ...
    assert ck._job is not None
    with pytest.raises(ckpt.Error, match=r"version 3 is not higher than 5"):
        opt.step()  # ... which the wait before the update raises
    assert ck.pending is None
    opt.step()  # nothing pending any more
    ck.save(6)
    ck.wait_durable()
    assert ckpt.list_versions(daemon.root, "worker-errors") == [5, 6]
    ck.close()
    # A new registration: its first save is refused by save() itself.
    ck2 = ct.Checkpointer(daemon.socket, "worker-errors", model=model, optimizer=opt)
    with pytest.raises(ckpt.Error, match=r"version 2 is not higher than 6"):
        ck2.save(2)
    ck2.save(7)
    ck2.save(8)  # before any update: save() waits for version 7 first
    ck2.close()  # waits for the worker thread to have sent version 8: the daemon commits it
    deadline = time.monotonic() + 60
    while 8 not in ckpt.list_versions(daemon.root, "worker-errors") and time.monotonic() < deadline:
        time.sleep(0.01)
    # Version 7 may be superseded by 8 before it is persisted (the promoter then skips it, by
    # design); 8, sent by the worker thread before close() returned, must be there.
    listed = ckpt.list_versions(daemon.root, "worker-errors")
    assert listed in ([5, 6, 7, 8], [5, 6, 8]), listed


def test_the_stall_the_daemon_records_is_the_trainers_not_the_worker_threads(start_daemon):
    """The worker thread waits for each capture; the stall the next snapshot reports to the
    daemon (ckptd_snapshot_stall_seconds) is the time the trainer blocked, not that wait."""
    d = start_daemon(extra_args=["--metrics-listen", "127.0.0.1:0"])
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", d.log()).group(1)

    def stall_sum():
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return float(re.search(r"^ckptd_snapshot_stall_seconds_sum (\S+)$", text, re.M).group(1))

    model, opt, _ = make(scheduler=False)
    ck = ct.Checkpointer(d.socket, "stall", model=model, optimizer=opt)
    train_step(model, opt, None, 1)
    ck.save(1)  # sent by save() itself
    train_step(model, opt, None, 2)
    ck.save(2)  # the worker thread's
    job = ck._job
    deadline = time.monotonic() + 60
    while not job.done() and time.monotonic() < deadline:  # the worker's wait is over ...
        time.sleep(0.001)
    before = stall_sum()
    train_step(model, opt, None, 3)  # ... so the trainer hardly blocks here
    stall = ck.last_stall_s
    ck.save(3)  # reports that stall ...
    ck.wait_snapshot()  # ... once the worker thread has sent it
    assert abs((stall_sum() - before) - stall) < 1e-8
    ck.close()
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        ck.client.report_stall(-1)


def test_a_second_checkpointer_on_an_open_ones_model_is_refused_until_it_is_closed(daemon):
    """A second Checkpointer on the same model or optimizer is refused while the first is
    open: it would leave the first one's hooks on them, waiting on the first registration at
    every step."""
    model, opt, sched = make()
    first = ct.Checkpointer(daemon.socket, "twice", model=model, optimizer=opt)
    with pytest.raises(ValueError, match=r"already checkpointed by an open Checkpointer \(job 'twice', rank 0\)"):
        ct.Checkpointer(daemon.socket, "twice-b", model=model)
    other_model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"this optimizer is already checkpointed"):
        ct.Checkpointer(daemon.socket, "twice-c", model=other_model, optimizer=opt)
    # The refused ones changed nothing: the first still saves and its hooks still wait.
    train_step(model, opt, sched, 1)
    first.save(1)
    first.wait_durable(1)
    first.close()
    with ct.Checkpointer(daemon.socket, "twice", model=model, optimizer=opt) as second:
        assert second.load("latest") == 1
        train_step(model, opt, sched, 2)
        second.save(2)
        second.wait_durable(2)
    # Closed by the with-statement: a third may follow.
    ct.Checkpointer(daemon.socket, "twice", model=model, optimizer=opt).close()
