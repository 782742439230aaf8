"""Whether a loss curve tracks another's: the checks bench/train_curves.py applies (issue 7).

One seed (compare_curves): the 50-step moving averages within CURVE_RTOL at every step after
the first SMOOTH, the final means within FINAL_RTOL; given the gaps of an eager twin (the same
math with other rounding), the bounds widen to TWIN_FACTOR times the twin's.
Paired seeds (compare_seeds): the geometric mean over seeds of ours / eager, for the mean loss
after step SMOOTH and for the final loss, within SEED_RTOL or 3 standard errors.
"""
import math

CURVE_RTOL = 0.10  # 50-step moving averages, every step after the first 50
FINAL_RTOL = 0.05  # mean of the last 100 steps (or the last fifth of a shorter run)
SMOOTH = 50
TWIN_FACTOR = 2.0
SEED_RTOL = 0.05


def moving_average(values, width):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def final_window(steps):
    """How many last steps the final mean covers: 100, or the last fifth of a shorter run."""
    return max(1, min(100, steps // 5))


def compare_curves(eager, mine, twin=None):
    """Gaps between two loss curves. twin: compare_curves(eager, eager twin), the gaps two
    correct eager runs that differ only in rounding show on the same seed; the bounds are
    then max(tolerance, TWIN_FACTOR × the twin's gap)."""
    ma_e, ma_m = moving_average(eager, SMOOTH), moving_average(mine, SMOOTH)
    start = min(SMOOTH, len(eager) - 1)
    gaps = [abs(a - b) / abs(a) for a, b in zip(ma_e[start:], ma_m[start:])]
    tail = final_window(len(eager))
    mean_e, mean_m = sum(eager[-tail:]) / tail, sum(mine[-tail:]) / tail
    final_gap = abs(mean_m - mean_e) / abs(mean_e)
    worst = max(gaps) if gaps else 0.0
    bound_worst, bound_final = CURVE_RTOL, FINAL_RTOL
    result = {"worst_smoothed_gap": worst, "worst_at": start + gaps.index(worst) if gaps else 0,
              "final_mean_eager": mean_e, "final_mean_mha": mean_m, "final_gap": final_gap}
    if twin is not None:
        bound_worst = max(bound_worst, TWIN_FACTOR * twin["worst_smoothed_gap"])
        bound_final = max(bound_final, TWIN_FACTOR * twin["final_gap"])
        result.update(twin_worst_gap=twin["worst_smoothed_gap"], twin_final_gap=twin["final_gap"])
    result.update(bound_worst=bound_worst, bound_final=bound_final,
                  ok=worst <= bound_worst and final_gap <= bound_final)
    return result


def compare_seeds(eager_runs, mha_runs):
    """Many seeds: does ours learn as fast and as far as eager, beyond what chaos does?

    Per run two statistics, in logs (spikes are multiplicative): the mean loss after the first
    SMOOTH steps (how fast and how far it learns) and the final mean (where it ends). Seeds are
    paired (same initial parameters and batches), so the test is on the per-seed differences:
    their mean must be within max(log(1 + SEED_RTOL), 3 standard errors), read as a ratio.
    """
    n = len(eager_runs)
    tail = final_window(len(eager_runs[0]))
    stats = {"learn": lambda r: sum(r[SMOOTH:]) / max(1, len(r) - SMOOTH), "final": lambda r: sum(r[-tail:]) / tail}
    result = {"seeds": n}
    for name, stat in stats.items():
        diffs = [math.log(stat(m)) - math.log(stat(e)) for e, m in zip(eager_runs, mha_runs)]
        mean = sum(diffs) / n
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(1, n - 1))
        bound = max(math.log1p(SEED_RTOL), 3 * sd / math.sqrt(n))
        result[name] = {"ratio": math.exp(mean), "bound_ratio": math.exp(bound), "ok": abs(mean) <= bound,
                        "per_seed_ratio": [math.exp(d) for d in diffs]}
    result["ok"] = all(result[name]["ok"] for name in stats)
    return result
