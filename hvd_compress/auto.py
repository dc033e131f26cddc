"""Compression.auto(): the compression with the shortest predicted step, chosen from the job's own measurements.

    opt = hc.DistributedOptimizer(keras.optimizers.AdamW(1e-3), compression=hc.Compression.auto())
    model.fit(..., callbacks=[hc.callbacks.BroadcastGlobalVariablesCallback(0), ...])

For its first `calibration_steps` steps the optimizer averages at full precision (Horovod's fp32 allreduce, as
`Compression.none`). After the last of them, hvd_compress's model.fit callbacks call `decide`:

1. the step: this rank's median wall time over the calibration steps after the first (which traced);
2. the link: a float32 allreduce of the model's gradient and one of a sixteenth of it, timed (the median of three
   each): their bytes and times give the rate and the latency of a round (cost.Link); `link=` replaces this by a
   rate the user gives (the job's production link, measured elsewhere);
3. the compute: the step less the full gradient's allreduce;
4. rank 0's figures are the job's: it predicts every candidate's step with the cost model (cost.predict; its own
   costs from the published CPU tables, scaled to this machine by the time of a fixed pass over 16M floats,
   cost.probe_s, run on every rank at once), keeps the fastest of those whose
   measured accuracy risk under the wrapped optimizer is low (advise.ACCURACY), and keeps full precision unless
   that one is predicted faster by more than advise.MARGIN; the choice is broadcast, so every rank takes it;
5. rank 0 logs the table and the reason; the optimizer re-plans its exchange for the choice
   (DistributedOptimizer.hc_switch_compression) and model.fit retraces its step. From then on the choice is the
   optimizer's compression: model files save it, and a loaded file trains with it.

A custom loop runs each step through `train_step`, which times it and decides after the calibration's last step;
the loop then makes its tf.function anew:

    auto = hc.Compression.auto()
    opt = hc.DistributedOptimizer(keras.optimizers.AdamW(1e-3), compression=auto, warmup_steps=100)
    step = tf.function(train_one_batch)  # its forward pass, tape.gradient and opt.apply_gradients
    for x, y in dataset:
        loss, decided = auto.train_step(opt, model.trainable_variables, lambda: step(x, y).numpy())
        if decided:
            step = tf.function(train_one_batch)  # the chosen exchange's step

(Once it has decided, the optimizer's compression is the choice, and `opt.hc_auto` is None.) Nothing stays at full
precision in silence: an optimizer step that nothing times (no hvd_compress callback in model.fit, a loop that
does not call train_step) is refused where it is traced, and a step traced before the decision that runs after it
(a loop that kept its tf.function) fails with the fix (`guard_step`).
"""
import logging
import math
import statistics
import time

import numpy as np

from hvd_compress.compressor import NoneCompressor

log = logging.getLogger("hvd_compress")

#: the methods auto() chooses among by default (hc.methods' names; each at its defaults)
CANDIDATES = ("fp16", "onebit", "quantize8", "quantize4", "topk", "powersgd")
#: under optimizers other than SGD and Adam(W), which no accuracy table covers: the methods whose error an adaptive
#: optimizer's statistics tolerate (16 bits; 8-bit codes, level with AdamW on the transformer)
OTHER_OPTIMIZERS = ("fp16", "quantize8")


class AutoCompression(NoneCompressor):
    """Compression.auto(methods=CANDIDATES, calibration_steps=10, link=None): full precision until it decides, then
    the chosen compression (see the module's docstring). methods: the names of hc.methods to choose among; link: a
    rate ('100mbit', '1gbit', ...) to predict with instead of the measured one."""

    def __init__(self, methods=CANDIDATES, calibration_steps=10, link=None):
        from hvd_compress import methods as registry
        methods = list(methods)
        unknown = sorted(set(methods) - set(registry.METHODS))
        if not methods or unknown:
            raise ValueError(f"Compression.auto(methods={methods!r}): give names of hc.methods' compressions "
                             f"({sorted(registry.METHODS)}); unknown: {unknown}.")
        if isinstance(calibration_steps, bool) or not isinstance(calibration_steps, int) or calibration_steps < 3:
            raise ValueError(f"Compression.auto(calibration_steps={calibration_steps!r}): an integer >= 3 (the first "
                             "step traces, the others are timed).")
        if link is not None:
            from hvd_compress import cost
            cost.Link.parse(link)  # a bad rate is refused here, before any step
        self.methods, self.calibration_steps, self.link = methods, calibration_steps, link
        self._begun, self._times, self.decision, self.reason = None, {}, None, None
        self._decided = None  # a tf.Variable once a step is traced: whether it has decided since (guard_step)

    def __repr__(self):
        return f"Compression.auto(methods={self.methods!r}, calibration_steps={self.calibration_steps}, link={self.link!r})"

    # -- between steps (hvd_compress's callbacks) ------------------------------------------------------------------
    def batch_begins(self, step):
        self._begun = (step, time.perf_counter())

    def batch_ends(self, step):
        """Records the wall time of the optimizer's step `step` (it ran between batch_begins and now)."""
        if self._begun is not None and step not in self._times and self.decision is None:
            self._times[step] = time.perf_counter() - self._begun[1]
        self._begun = None

    def guard_step(self, grads, variables):
        """The gradients of an optimizer step being traced (or run eagerly) while auto has not decided, made to wait
        for a check that it still has not when the step runs: a step traced now runs the calibration's full-precision
        exchange, which the decision replaces. `variables`, those the step changes (the model's, the optimizer's
        iterations), are read after the check, so that in the traced step their updates wait for it too (a failed
        check changes neither the weights nor the optimizer's step). Refuses a step that nothing times (it would never decide)."""
        import tensorflow as tf
        if self._begun is None:
            raise ValueError(
                f"hc.DistributedOptimizer(compression={self!r}): nothing times this optimizer step, so auto() would "
                "never decide and the job would stay at full precision. Train with model.fit and hvd_compress's "
                "BroadcastGlobalVariablesCallback or MetricAverageCallback, or run each step of a custom loop through "
                "auto.train_step(optimizer, variables, run_step); or give a compression (python -m "
                "hvd_compress.advise recommends one for your model and link).")
        if self._decided is None:
            with tf.init_scope(), tf.device("/CPU:0"):
                self._decided = tf.Variable(False, trainable=False, name="hc_auto_decided")
        if tf.executing_eagerly():
            return grads
        still_calibrating = tf.debugging.assert_equal(
            self._decided, False, message=(
                f"{self!r} has chosen its compression since this step was traced: the step still runs the "
                "calibration's full-precision exchange. Make the step's tf.function anew when auto.train_step returns "
                "decided=True (model.fit does so by itself)."))
        with tf.control_dependencies([still_calibrating]):
            reads = [tf.convert_to_tensor(v) for v in variables]  # (each variable's later updates follow its read)
        with tf.control_dependencies(reads):
            return [None if g is None else
                    tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices)
                    else tf.identity(g) for g in grads]

    def due(self):
        """Whether the calibration is over (it has timed `calibration_steps` steps, whatever step the optimizer
        started from: a restored checkpoint too) and nothing is decided yet."""
        return self.decision is None and len(self._times) >= self.calibration_steps

    def train_step(self, optimizer, variables, run_step):
        """A custom loop's step: `run_step()` (one optimizer step, its result fetched), timed while the calibration
        lasts, and after its last step `decide(optimizer, variables)`. Returns (run_step's result, whether it
        decided now: the caller then makes its tf.function anew)."""
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # (inside a LossScaleOptimizer)
        if self.decision is not None:
            return run_step(), False
        self.batch_begins(int(optimizer.iterations.numpy()))
        result = run_step()
        return result, self.step_ended(optimizer, variables)

    def step_ended(self, optimizer, variables):
        """After a step that batch_begins preceded: records its time and, once the calibration is over, decides
        (model.fit's callbacks and train_step). Returns whether it decided now: the caller retraces its step."""
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # (inside a LossScaleOptimizer)
        self.batch_ends(int(optimizer.iterations.numpy()))
        if not self.due():
            return False
        self.decide(optimizer, variables)
        return True

    def decide(self, optimizer, variables):
        """Measures the link, predicts every candidate's step and switches the optimizer to the choice, for
        `variables` (the model's trainable ones, in its steps' order): on every rank at once, between the same two
        steps. The caller retraces the step (model.fit: model.make_train_function(force=True); a custom loop: a new
        tf.function). Returns the chosen method's name."""
        import horovod.tensorflow as hvd
        from hvd_compress import cost
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # (inside a LossScaleOptimizer)
        process_set = optimizer.hc_process_set
        variables = list(variables)
        shapes = [tuple(int(d) for d in v.shape) for v in variables]
        elements = int(sum(np.prod(s, dtype=np.int64) for s in shapes))
        timed = [t for step, t in sorted(self._times.items())[1:]]  # the first step traced
        step_s = statistics.median(timed) if timed else float("nan")
        full, small = (timed_allreduce(n, process_set) for n in (elements, max(1, elements // 16)))
        probe = cost.probe_s()  # (every rank at once, sharing the machine as its steps do)
        choice, table = None, ""
        if process_set.rank() == 0:
            choice, table = self.choose(optimizer, shapes, step_s, full, small, process_set.size(), probe)
        choice = hvd.broadcast_object(choice, root_rank=0, process_set=process_set, name="hc.auto.decision")
        if hvd.rank() == 0:
            log.warning("hvd_compress: Compression.auto() after %d steps: %s\n%s", len(self._times), choice["why"],
                        table)
        from hvd_compress import methods as registry  # (none too: the file then says so, and does not calibrate again)
        optimizer.hc_switch_compression(registry.compression(choice["method"]), variables)
        self.decision, self.reason = choice["method"], choice["why"]  # (once the optimizer has switched)
        if self._decided is not None:
            self._decided.assign(True)  # (a step traced before now fails if it runs: guard_step)
        return self.decision

    def choose(self, optimizer, shapes, step_s, full, small, ranks, probe_s):
        """(the decision as {"method", "why"}, the predictions as a table) from rank 0's measurements: the step at
        full precision `step_s`, allreduces of the gradient (`full` s) and of a sixteenth of it (`small` s), and the
        probe's pass (`probe_s`, cost.probe_s), by which the published per-element costs are scaled to this machine."""
        from hvd_compress import advise, cost
        elements = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        link = fitted_link(4 * elements, full, 4 * max(1, elements // 16), small, ranks)
        # In the step the gradient's allreduce took its bytes' time on the link (an eager one also pays Python's and
        # Horovod's hand-over, in the fitted latency). The calibration ran hc's full-precision exchange ("none":
        # Keras's apply in fused kernels under SGD), and the machine's costs are each method's against the bare
        # optimizer: the compute is the step less both.
        full_link_s = cost.predict("none", shapes, 0.0, cost.Cluster(ranks, cost.Link(link.rate_bps, 0.0)),
                                   cost.Machine("link only", {}, 0.0)).link_s
        kind = kind_of(optimizer)
        machine = cost.published_cpu(kind or "sgd").scaled_by_probe(probe_s)
        none_s = machine.own_s("none", elements, cost.planned_collectives("none", shapes, ranks))
        compute_s = max(step_s - full_link_s - none_s, 1e-6)
        baseline_s = step_s  # what the job takes now, at full precision
        if self.link is not None:  # the given link: full precision's step is predicted on it too
            link = cost.Link.parse(self.link, link.latency_s)
            baseline_s = compute_s + cost.predict("none", shapes, 0.0, cost.Cluster(ranks, link), machine).total_s
        rows = advise.advise(shapes, compute_s, cost.Cluster(ranks, link), kind or "sgd", machine, self.methods,
                             hierarchical=False)
        safe = [a for a in rows if (a.risk == "low" if kind else a.step.method in OTHER_OPTIMIZERS)]
        best = min(safe, key=lambda a: a.step.total_s, default=None)
        facts = (f"the step at full precision {step_s * 1e3:.1f} ms, an eager allreduce of the gradient "
                 f"{full * 1e3:.1f} ms, the link {link.rate_bps / 1e9:.3g} Gbit/s "
                 f"({'given' if self.link else 'measured'}), "
                 f"the methods' own costs: {machine.name} (the probe here {probe_s * 1e3:.1f} ms)")
        if best is not None and best.step.total_s < (1 - advise.MARGIN) * baseline_s:
            why = (f"{best.step.method}, predicted {best.step.total_s * 1e3:.1f} ms a step against "
                   f"{baseline_s * 1e3:.1f} at full precision; {facts}")
            return dict(method=best.step.method, why=why), advise.render(rows)
        why = (f"no compression: no method of low accuracy risk is predicted more than {advise.MARGIN:.0%} faster than "
               f"full precision's {baseline_s * 1e3:.1f} ms; {facts}")
        return dict(method="none", why=why), advise.render(rows)


def refuse_outside_distributed_optimizer(compression, where):
    """Compression.auto() decides inside hc.DistributedOptimizer only (its fit callbacks, or train_step); given to
    `where` it would stay at full precision in silence, so it is refused there."""
    if isinstance(compression, AutoCompression):
        raise ValueError(f"{where}: {compression!r} chooses inside hc.DistributedOptimizer only (model.fit with "
                         "hvd_compress's callbacks, or its train_step in a custom loop); here give a compression, "
                         "e.g. the one `python -m hvd_compress.advise` recommends for your model and link.")


def kind_of(optimizer):
    """The optimizer's kind for the accuracy tables ("sgd", "adamw"), None for another (then only OTHER_OPTIMIZERS)."""
    from hvd_compress import rules
    return "adamw" if rules.is_adam(optimizer) else "sgd" if rules.is_sgd(optimizer) else None


def timed_allreduce(elements, process_set, repeats=3):
    """The median seconds of an eager float32 allreduce of `elements` elements over process_set (every rank)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    tensor = tf.zeros([elements], tf.float32)
    hvd.allreduce(tensor, process_set=process_set, name="hc.auto.link")  # (the first one sets up)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        hvd.allreduce(tensor, process_set=process_set, name="hc.auto.link").numpy()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def fitted_link(big_bytes, big_s, small_bytes, small_s, ranks):
    """The cost.Link that takes big_s for a ring allreduce of big_bytes and small_s for one of small_bytes: the rate
    from the difference, the latency of a round from the rest (2 (n-1) rounds)."""
    from hvd_compress import cost, exchange
    big, small = (exchange.allreduce_bytes(b, ranks) for b in (big_bytes, small_bytes))
    if big <= small or big_s - small_s < 0.2 * big_s:  # one rank (no bytes), or the bytes hardly cost more time:
        # the link is no bottleneck at this size
        return cost.Link(math.inf, big_s / max(1, 2 * (ranks - 1)))
    rate = (big - small) * 8 / (big_s - small_s)
    latency = max(0.0, (small_s - small * 8 / rate) / max(1, 2 * (ranks - 1)))
    return cost.Link(rate, latency)
