"""MomentumErrorFeed's kernel and error feedback's a = g + e (tf_ops/gpu/feedback_kernels.cu) against NumPy's
float32 arithmetic, one rounding per operation (what -fmad=false keeps), bit for bit; in place (a in g's buffer)
too."""
import numpy as np

SIZES = [1, 1000, 100_003]


def reference(g, m, e, lr, mu, scale, nesterov):
    lr, mu, scale = np.float32(lr), np.float32(mu), np.float32(scale)
    velocity = mu * m + g
    return velocity, lr * (mu * velocity + g if nesterov else velocity) + scale * e


def check(run):
    cp, k, rng = run.cp, run.k, run.rng
    for n in SIZES:
        g, m, e = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
        for nesterov in (False, True):
            for lr, mu, scale in ((0.1, 0.9, 1.0), (0.0375, 0.95, 0.75)):
                want_m, want_a = reference(g, m, e, lr, mu, scale, nesterov)
                case = f"n={n} nesterov={nesterov} lr={lr} scale={scale}"
                m_new, a = cp.empty(n, cp.float32), cp.empty(n, cp.float32)
                k.hc_momentum_error_feed(cp.asarray(g), cp.asarray(m), cp.asarray(e), n, lr, mu, scale,
                                         int(nesterov), m_new, a, None)
                run.expect("hc_momentum_error_feed", case, m_new, want_m)
                run.expect("hc_momentum_error_feed", case + " a", a, want_a)
                in_place = cp.asarray(g)
                k.hc_momentum_error_feed(in_place, cp.asarray(m), cp.asarray(e), n, lr, mu, scale, int(nesterov),
                                         m_new, in_place, None)
                run.expect("hc_momentum_error_feed", case + " a in g", in_place, want_a)
        a = cp.empty(n, cp.float32)
        k.hc_error_feed(cp.asarray(g), cp.asarray(e), n, a, None)
        run.expect("hc_error_feed", f"n={n}", a, g + e)
        in_place = cp.asarray(e)
        k.hc_error_feed(cp.asarray(g), in_place, n, in_place, None)
        run.expect("hc_error_feed", f"n={n} a in e", in_place, g + e)


def bench(run, n):
    cp, k = run.cp, run.k
    g, m, e = (cp.asarray(run.rng.standard_normal(n).astype(np.float32)) for _ in range(3))
    m_new, a = cp.empty_like(g), cp.empty_like(g)
    run.time("hc_error_feed", "", n, 12 * n, lambda: k.hc_error_feed(g, e, n, a, None))
    run.time("hc_momentum_error_feed", "nesterov", n, 20 * n,
             lambda: k.hc_momentum_error_feed(g, m, e, n, 0.1, 0.9, 1.0, 1, m_new, a, None))
