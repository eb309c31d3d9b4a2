"""Fused GRPO loss op (csrc/) against the PyTorch reference (flowgrpo/ops/reference.py).

The float64 ground truth is ``grpo_loss_ref`` run on the same inputs upcast to float64.
The extension is built once per session (JIT, cached); without a compiler these tests skip.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from flowgrpo.ops import active_backend, grpo_loss, grpo_loss_ref
from flowgrpo.ops import build, fused

RTOL_FP32 = 1e-5


@pytest.fixture(scope="session")
def ext():
    if build.disabled_by_env():
        pytest.skip("FLOWGRPO_NO_EXT=1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend = active_backend("cpu")
    if backend != "compiled":
        pytest.skip(f"fused op not built: {build.STATE.error}")
    return build.STATE


# ----------------------------------------------------------------------------- input generation


def make_case(n=6, shape=(4, 5, 7), *, dtype=torch.float32, std=(0.05, 0.8), guard=False, kl=False,
              target="mixed", adv="mixed", clip=0.2, seed=0):
    """Random transitions whose log-ratios hit chosen targets (kept 0.02 away from the clip bounds,
    so float32 and float64 take the same branch). Returns (args, kwargs) in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    shp = (n, *shape)
    lo, hi = std
    s = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(lo), math.log(hi), generator=g))
    sb = s.view(n, *([1] * len(shape)))
    mo = torch.randn(shp, generator=g, dtype=torch.float64)
    x = mo + sb * torch.randn(shp, generator=g, dtype=torch.float64)
    mu = mo + 0.05 * sb * torch.randn(shp, generator=g, dtype=torch.float64)
    mr = mu + 0.1 * torch.randn(shp, generator=g, dtype=torch.float64)
    ks = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    w = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    if adv == "zero":
        a = torch.zeros(n, dtype=torch.float64)
    else:
        a = torch.randn(n, generator=g, dtype=torch.float64)
        a = torch.where(a.abs() < 0.1, torch.full_like(a, 0.5), a)
    # round the latents to the test dtype first, then build logp_old from the rounded values
    x, mu, mo, mr = (t.to(dtype).double() for t in (x, mu, mo, mr))
    lp_hi, lp_lo = math.log(1 + clip), math.log(1 - clip)
    if target == "high":
        lr = torch.full((n,), lp_hi + 0.3, dtype=torch.float64)
    elif target == "low":
        lr = torch.full((n,), lp_lo - 0.3, dtype=torch.float64)
    else:  # inside, above and below the clip range
        choices = torch.tensor([0.0, 0.5 * lp_hi, 0.5 * lp_lo, lp_hi + 0.05, lp_lo - 0.05,
                                lp_hi + 0.4, lp_lo - 0.4], dtype=torch.float64)
        lr = choices[torch.randint(0, len(choices), (n,), generator=g)]
    logp = grpo_loss_ref(x, mu, mo, s, torch.zeros(n, dtype=torch.float64), a, w, clip_range=clip).logp
    if guard:
        mse = ((mu - mo) ** 2).reshape(n, -1).mean(1)
        lpo = logp - (lr - mse / (2 * s)) / s
    else:
        lpo = logp - lr
    cast = lambda t: t.to(dtype)  # noqa: E731
    args = [cast(t) for t in (x, mu, mo, s, lpo, a, w)]
    kwargs = dict(clip_range=clip, guard=guard)
    if kl:
        kwargs.update(mean_ref=cast(mr), kl_sigma=cast(ks), beta=0.3)
    return args, kwargs


def run(fn, args, kwargs, dtype=None, **extra):
    """Loss, stats and d loss / d mean, with inputs optionally cast to ``dtype``."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    a = [cast(t) for t in args]
    a[1] = a[1].detach().clone().requires_grad_(True)
    kw = {k: (cast(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    stats = fn(*a, **kw, **extra)
    loss = stats.loss
    loss.backward()
    return loss.detach(), stats, a[1].grad


def rel_err(a, b):
    a, b = a.double(), b.double()
    scale = b.abs().max()
    diff = (a - b).abs().max()
    if scale == 0:
        return float(diff)
    return float(diff / scale)


def check_against_float64(args, kwargs, tol=RTOL_FP32):
    loss, st, grad = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
    loss64, st64, grad64 = run(grpo_loss_ref, args, kwargs, dtype=torch.float64)
    assert loss.dtype == torch.float32 and st.ratio.dtype == torch.float32
    assert grad.dtype == args[1].dtype and grad.shape == args[1].shape
    assert rel_err(loss, loss64) < tol, (float(loss), float(loss64))
    for k in ("logp", "ratio", "kl"):
        assert rel_err(getattr(st, k), getattr(st64, k)) < tol, k
    for k in ("clipped_high", "clipped_low"):
        assert torch.equal(getattr(st, k), getattr(st64, k)), k
    assert rel_err(grad, grad64) < tol
    return loss, st, grad, loss64, st64, grad64


# ----------------------------------------------------------------------------- float32 vs float64

CASES = {
    "mixed": dict(),
    "adv_zero": dict(adv="zero"),
    "all_clipped_high": dict(target="high"),
    "all_clipped_low": dict(target="low"),
    "n1": dict(n=1),
    "d1": dict(shape=(1,)),
    "d_odd": dict(shape=(37,)),  # not a multiple of any vector width
    "d_multi_chunk": dict(n=3, shape=(5, 4099)),  # several CPU/CUDA chunks + a ragged tail
    "tiny_std": dict(std=(1e-6, 1e-5)),
    "huge_std": dict(std=(1e3, 1e4)),
}


@pytest.mark.parametrize("kl", [False, True], ids=["nokl", "kl"])
@pytest.mark.parametrize("guard", [False, True], ids=["noguard", "guard"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_matches_float64_reference(ext, case, guard, kl):
    args, kwargs = make_case(guard=guard, kl=kl, seed=list(CASES).index(case), **CASES[case])
    tol = RTOL_FP32
    if guard and case == "huge_std":
        # GRPO-Guard's log r^ = s (logp - logp_old) + mse / (2 s) multiplies the float32 rounding
        # of logp (|logp| ~ 10, ulp ~ 1e-6) by s ~ 1e3..1e4: no float32 evaluation reaches 1e-5
        # here, the reference in float32 included. Require the reference's own float32 accuracy.
        l32, s32, g32 = run(grpo_loss_ref, args, kwargs)
        l64, s64, g64 = run(grpo_loss_ref, args, kwargs, dtype=torch.float64)
        ref_err = max(rel_err(l32, l64), rel_err(s32.ratio, s64.ratio), rel_err(g32, g64))
        assert ref_err > RTOL_FP32  # the premise: the float32 reference misses 1e-5 as well
        tol = 2 * ref_err
    loss, st, grad, loss64, st64, grad64 = check_against_float64(args, kwargs, tol=tol)
    if case == "all_clipped_high":
        assert bool(st.clipped_high.all())
    if case == "all_clipped_low":
        assert bool(st.clipped_low.all())
    if case == "adv_zero" and not kl:
        assert float(loss) == 0.0 and bool((grad == 0).all())


def test_clipped_rows_have_no_policy_gradient(ext):
    # A > 0 and r > 1 + eps (or A < 0 and r < 1 - eps): the clipped branch wins, no gradient.
    args, kwargs = make_case(target="high", adv="mixed", seed=3)
    args[5] = args[5].abs()
    _, _, grad = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
    assert bool((grad == 0).all())
    args[5] = -args[5]
    _, _, grad = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
    assert bool((grad != 0).any())


@pytest.mark.parametrize("guard", [False, True], ids=["noguard", "guard"])
def test_on_policy_ties_and_zero_clip(ext, guard):
    """r = 1 exactly on-policy; with clip_range = 0 both branches tie at the bounds: torch.maximum
    gives each half the gradient and torch.clamp's backward passes none at a bound, so the
    gradient is half the unclipped one; the fused op must reproduce that."""
    args, kwargs = make_case(n=5, guard=guard, seed=11)
    args[2] = args[1].clone()  # mu_old = mu
    for fn, dtype in ((lambda *a, **k: grpo_loss(*a, **k, backend="fused"), torch.float32),
                      (grpo_loss_ref, torch.float64)):
        a = [t.to(dtype) for t in args]
        # logp_old = this implementation's own logp, so log r = 0 exactly
        a[4] = fn(*a, **kwargs).logp
        loss, st, grad = run(fn, a, dict(kwargs, clip_range=0.0))
        assert bool((st.ratio == 1.0).all())
        assert not bool(st.clipped_high.any() or st.clipped_low.any())
        if dtype == torch.float32:
            out32 = (loss, grad)
        else:
            out64 = (loss, grad)
    assert rel_err(out32[0], out64[0]) < RTOL_FP32
    assert rel_err(out32[1], out64[1]) < RTOL_FP32
    assert float(out64[1].abs().max()) > 0


def test_matches_fp32_reference_exactly_enough(ext):
    # fused vs the same reference in fp32 (not only vs float64)
    args, kwargs = make_case(guard=True, kl=True, seed=5)
    l1, s1, g1 = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
    l2, s2, g2 = run(grpo_loss_ref, args, kwargs)
    assert rel_err(l1, l2) < RTOL_FP32 and rel_err(g1, g2) < RTOL_FP32
    assert rel_err(s1.ratio, s2.ratio) < RTOL_FP32


# ----------------------------------------------------------------------------- reduced precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("guard,kl", [(False, False), (True, True)], ids=["plain", "guard_kl"])
def test_low_precision_within_reference_error(ext, dtype, guard, kl):
    args, kwargs = make_case(n=8, shape=(3, 33), dtype=dtype, guard=guard, kl=kl, std=(0.2, 0.8), seed=7)
    loss, st, grad = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
    lr, sr, gr = run(grpo_loss_ref, args, kwargs)  # the reference run in bf16/fp16
    l64, s64, g64 = run(grpo_loss_ref, args, kwargs, dtype=torch.float64)
    assert grad.dtype == dtype and loss.dtype == torch.float32
    for mine, ref, truth in ((loss, lr, l64), (st.ratio, sr.ratio, s64.ratio),
                             (st.logp, sr.logp, s64.logp), (st.kl, sr.kl, s64.kl),
                             (grad, gr, g64)):
        assert rel_err(mine, truth) <= max(2 * rel_err(ref, truth), RTOL_FP32)


# ----------------------------------------------------------------------------- layouts, dtypes


def test_noncontiguous_and_mixed_dtypes(ext):
    args, kwargs = make_case(n=4, shape=(6, 10), guard=True, kl=True, seed=9)
    ref = run(grpo_loss_ref, args, kwargs, dtype=torch.float64)
    a = list(args)
    a[0] = a[0].transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous
    a[2] = a[2].double()  # mixed dtypes promote
    kw = dict(kwargs, mean_ref=kwargs["mean_ref"][:, :, :].clone().transpose(1, 2).contiguous().transpose(1, 2))
    assert not a[0].is_contiguous()
    loss, st, grad = run(lambda *x, **k: grpo_loss(*x, **k, backend="fused"), a, kw)
    assert rel_err(loss, ref[0]) < RTOL_FP32 and rel_err(grad, ref[2]) < RTOL_FP32
    assert grad.dtype == torch.float32


def test_other_input_requiring_grad_uses_reference(ext):
    args, kwargs = make_case(n=4, seed=2)
    adv = args[5].clone().requires_grad_(True)
    mu = args[1].clone().requires_grad_(True)
    loss = grpo_loss(args[0], mu, args[2], args[3], args[4], adv, args[6], **kwargs).loss
    loss.backward()
    assert adv.grad is not None and mu.grad is not None


def test_thread_count_does_not_change_results(ext):
    args, kwargs = make_case(n=3, shape=(20000,), guard=True, kl=True, seed=4)
    nt = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        l1, s1, g1 = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
        torch.set_num_threads(max(2, nt))
        l2, s2, g2 = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
    finally:
        torch.set_num_threads(nt)
    assert torch.equal(l1, l2) and torch.equal(g1, g2) and torch.equal(s1.logp, s2.logp)


def test_large_gradient_buffer(ext):
    # > 4 MiB gradient: the CPU kernel allocates it 2 MiB-aligned with a huge-page hint
    args, kwargs = make_case(n=4, shape=(300_000,), guard=True, kl=True, seed=6)
    l1, s1, g1 = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), args, kwargs)
    l2, s2, g2 = run(grpo_loss_ref, args, kwargs)
    assert rel_err(l1, l2) < RTOL_FP32 and rel_err(g1, g2) < RTOL_FP32
    assert g1.is_contiguous() and g1.shape == args[1].shape
    g1.add_(1.0)  # an ordinary, writable tensor
    del g1


def test_no_grad_forward(ext):
    args, kwargs = make_case(n=3, seed=8)
    with torch.no_grad():
        st = grpo_loss(*args, **kwargs, backend="fused")
        loss = st.loss
    sr = grpo_loss_ref(*args, **kwargs)
    ref = sr.loss
    assert rel_err(loss, ref) < RTOL_FP32 and rel_err(st.logp, sr.logp) < RTOL_FP32


# ----------------------------------------------------------------------------- torch.library


def _op_args(guard, kl, dtype=torch.float32, n=3, d=(2, 5), device="cpu"):
    args, kwargs = make_case(n=n, shape=d, guard=guard, kl=kl, dtype=dtype, seed=12)
    x, mu, mo, s, lpo, a, w = (t.to(device) for t in args)
    mu = mu.clone().requires_grad_(True)
    mr = kwargs["mean_ref"].to(device) if "mean_ref" in kwargs else None
    ks = kwargs["kl_sigma"].to(device) if "kl_sigma" in kwargs else None
    return (x, mu, mo, s, lpo, a, w, mr, ks, 0.2, kwargs.get("beta", 0.0), guard)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("guard,kl", [(False, False), (True, True)], ids=["plain", "guard_kl"])
def test_opcheck(ext, guard, kl, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if device == "cuda" and active_backend("cuda") != "compiled":
        pytest.skip(f"CUDA kernels not built: {build.STATE.notes or build.STATE.error}")
    args = _op_args(guard, kl, device=device)
    torch.library.opcheck(torch.ops.flowgrpo.grpo_loss_fwd.default, args)
    coef = torch.ops.flowgrpo.grpo_loss_fwd(*args)[4].detach()
    bargs = (torch.tensor(1.5, device=device), args[0], args[1].detach(), args[2] if guard else None,
             args[7] if kl else None, coef)
    torch.library.opcheck(torch.ops.flowgrpo.grpo_loss_bwd.default, bargs)


@pytest.mark.parametrize("guard,kl", [(False, False), (True, True)], ids=["plain", "guard_kl"])
def test_gradcheck_float64(ext, guard, kl):
    args = _op_args(guard, kl, dtype=torch.float64)
    x, mu, mo, s, lpo, a, w, mr, ks, clip, beta, _ = args
    # clip_range 0.2 and ratios 0.02 away from the bounds: the loss is smooth around mu
    f = lambda m: grpo_loss(x, m, mo, s, lpo, a, w, clip_range=clip, guard=guard,  # noqa: E731
                            mean_ref=mr, kl_sigma=ks, beta=beta, backend="fused").loss
    assert f(mu).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (mu,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_torch_compile_traces_the_op(ext):
    args, kwargs = make_case(n=4, shape=(3, 9), guard=True, kl=True, seed=13)
    fn = lambda *a, **k: grpo_loss(*a, **k, backend="fused")  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
    l1, s1, g1 = run(fn, args, kwargs)
    l2, s2, g2 = run(compiled, args, kwargs)
    assert torch.equal(l1, l2) and torch.equal(g1, g2) and torch.equal(s1.ratio, s2.ratio)


# ----------------------------------------------------------------------------- dispatch / fallback


def test_active_backend(ext):
    assert active_backend("cpu") == "compiled"
    assert active_backend("meta") == "reference"
    expected = "compiled" if ext.cuda else "reference"
    assert active_backend("cuda") == expected


def test_fallback_warns_once(monkeypatch):
    args, kwargs = make_case(n=3, seed=1)
    monkeypatch.setattr(fused, "fused_available", lambda device: False)
    monkeypatch.setattr(fused, "_warned", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        l1 = grpo_loss(*args, **kwargs).loss
        l2 = grpo_loss(*args, **kwargs).loss
    msgs = [r for r in rec if "fused GRPO loss op is unavailable" in str(r.message)]
    assert len(msgs) == 1
    ref = grpo_loss_ref(*args, **kwargs).loss
    assert torch.equal(l1, ref) and torch.equal(l2, ref)
    with pytest.raises(RuntimeError):
        grpo_loss(*args, **kwargs, backend="fused")


def test_no_ext_env_forces_reference(monkeypatch):
    monkeypatch.setenv("FLOWGRPO_NO_EXT", "1")
    assert active_backend("cpu") == "reference"
    args, kwargs = make_case(n=2, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit opt-out does not warn
        loss = grpo_loss(*args, **kwargs).loss
    assert torch.equal(loss, grpo_loss_ref(*args, **kwargs).loss)


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    """A fresh process without a C++ compiler (and an empty cache) runs the reference and warns once."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "from flowgrpo.ops import grpo_loss, grpo_loss_ref, active_backend\n"
        "x = torch.randn(3, 8); s = torch.ones(3); z = torch.zeros(3)\n"
        "with warnings.catch_warnings(record=True) as rec:\n"
        "    warnings.simplefilter('always')\n"
        "    a = grpo_loss(x, x, x, s, z, s, s, clip_range=0.2).loss\n"
        "    b = grpo_loss(x, x, x, s, z, s, s, clip_range=0.2).loss\n"
        "n = sum('fused GRPO loss op is unavailable' in str(r.message) for r in rec)\n"
        "ok = torch.equal(a, grpo_loss_ref(x, x, x, s, z, s, s, clip_range=0.2).loss)\n"
        "print('RESULT', active_backend('cpu'), n, ok)\n"
        "print('MESSAGE', [str(r.message) for r in rec])\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop("FLOWGRPO_NO_EXT", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")][0]
    assert line.split()[1:] == ["reference", "1", "True"], out.stdout + out.stderr
    assert "no C++ compiler" in out.stdout


def test_backend_reference_and_errors(ext):
    args, kwargs = make_case(n=2, seed=1)
    assert torch.equal(grpo_loss(*args, **kwargs, backend="reference").loss, grpo_loss_ref(*args, **kwargs).loss)
    with pytest.raises(ValueError):
        grpo_loss(*args, **kwargs, backend="nope")
    with pytest.raises(ValueError):
        grpo_loss(*args, clip_range=0.2, mean_ref=args[1], beta=0.1)


def test_sources_are_package_data():
    src = build.source_dir()
    for name in build.CPP_SOURCES + build.CUDA_SOURCES + build.HEADERS:
        assert (src / name).is_file(), name


def test_doctor_report(ext):
    from flowgrpo.ops.doctor import doctor_report

    lines = doctor_report()
    text = "\n".join(lines)
    assert "torch" in text and "cpu" in text and "compiled" in text


# ----------------------------------------------------------------------------- CUDA (on a GPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["mixed", "d_multi_chunk", "n1", "d_odd", "tiny_std"])
def test_cuda_matches_float64_reference(ext, case, dtype):
    if active_backend("cuda") != "compiled":
        pytest.skip(f"CUDA kernels not built: {build.STATE.notes or build.STATE.error}")
    args, kwargs = make_case(guard=True, kl=True, dtype=dtype, seed=21, **CASES[case])
    dev = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t  # noqa: E731
    cargs = [dev(t) for t in args]
    ckw = {k: dev(v) for k, v in kwargs.items()}
    loss, st, grad = run(lambda *a, **k: grpo_loss(*a, **k, backend="fused"), cargs, ckw)
    l64, s64, g64 = run(grpo_loss_ref, args, kwargs, dtype=torch.float64)
    if dtype == torch.float32:
        tol_l = tol_g = RTOL_FP32
    else:
        lr, sr, gr = run(grpo_loss_ref, args, kwargs)
        tol_l = max(2 * rel_err(lr, l64), RTOL_FP32)
        tol_g = max(2 * rel_err(gr, g64), RTOL_FP32)
    assert rel_err(loss.cpu(), l64) < tol_l
    assert rel_err(grad.cpu(), g64) < tol_g
