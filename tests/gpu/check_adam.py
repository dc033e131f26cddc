"""The Adam kernels (tf_ops/gpu/adam_kernels.cu: 1-bit Adam's worker side, the frozen-variance step, the variable's
step with weight decay) against NumPy's float32 arithmetic, one rounding per operation (what -fmad=false keeps), bit
for bit (a bound on the momentum over d and on the step that cuts some elements, and none); outputs in their inputs'
buffers too."""
import numpy as np

SIZES = [1, 1000, 100_003]


def inputs(rng, n):
    g, m, e, mean = (rng.standard_normal(n).astype(np.float32) * np.float32(s) for s in (1, 0.3, 1e-3, 0.5))
    v = np.abs(rng.standard_normal(n).astype(np.float32)) * np.float32(1e-4)
    v[: n // 7] = 0  # coordinates that never had a gradient: d = epsilon
    return g, m, v, e, mean


def check(run):
    cp, k, rng = run.cp, run.k, run.rng
    for n in SIZES:
        g, m, v, e, mean = inputs(rng, n)
        for beta_1, epsilon, bound in ((0.9, 1e-7, np.inf), (0.99, 1e-3, 30.0)):
            keep, eps, alpha = np.float32(1.0 - beta_1), np.float32(epsilon), np.float32(3e-4)
            bound, max_step = np.float32(bound), np.float32(bound) * alpha
            d = np.sqrt(v) + eps
            case = f"n={n} beta_1={beta_1} epsilon={epsilon} bound={bound}"
            want_a = np.clip((m + (g - m) * keep) / d, -bound, bound) + e
            a = cp.empty(n, cp.float32)
            k.hc_adam_momentum_feed(cp.asarray(g), cp.asarray(m), cp.asarray(v), cp.asarray(e), n, keep, eps, bound,
                                    a, None)
            run.expect("hc_adam_momentum_feed", case, a, want_a)
            a = cp.asarray(g)  # a in g's buffer
            k.hc_adam_momentum_feed(a, cp.asarray(m), cp.asarray(v), cp.asarray(e), n, keep, eps, bound, a, None)
            run.expect("hc_adam_momentum_feed", case + " a in g", a, want_a)
            for exchanged in (True, False):
                want_m = mean * d if exchanged else m + (mean - m) * keep
                want_delta = np.clip(mean * alpha if exchanged else (want_m * alpha) / d, -max_step, max_step)
                m_new, delta = cp.asarray(m), cp.asarray(mean)  # in place: m_new in m's buffer, delta in mean's
                k.hc_adam_frozen_step(delta, m_new, cp.asarray(v), n, alpha, keep, eps, max_step, int(exchanged), m_new,
                                      delta, None)
                run.expect("hc_adam_frozen_step", f"{case} exchanged={exchanged} m", m_new, want_m)
                run.expect("hc_adam_frozen_step", f"{case} exchanged={exchanged} delta", delta, want_delta)
        for decay in (0.0, 1e-5):
            x = cp.asarray(m)
            k.hc_decay_and_subtract(x, cp.asarray(mean), n, np.float32(decay), None)
            run.expect("hc_decay_and_subtract", f"n={n} decay={decay}", x, (m - m * np.float32(decay)) - mean)


def bench(run, n):
    cp, k = run.cp, run.k
    g, m, v, e, mean = (cp.asarray(x) for x in inputs(run.rng, n))
    out, out2 = cp.empty_like(g), cp.empty_like(g)
    run.time("hc_adam_momentum_feed", "", n, 20 * n,
             lambda: k.hc_adam_momentum_feed(g, m, v, e, n, 0.1, 1e-7, 30.0, out, None))
    run.time("hc_adam_frozen_step", "1-bit Adam", n, 20 * n,
             lambda: k.hc_adam_frozen_step(mean, m, v, n, 3e-4, 0.1, 1e-7, 1e-3, 1, out, out2, None))
    run.time("hc_decay_and_subtract", "", n, 12 * n, lambda: k.hc_decay_and_subtract(out, mean, n, 1e-5, None))
