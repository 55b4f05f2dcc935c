"""Training claims beyond the table's rows: RA on the LRA tasks, LARA's isolated ablations
(one option changed per arm, on ListOps, where lara learns at this budget) and the
flexformer byte LM. Runs are cached like the table's (`train.claims.table.train_run`)."""

from __future__ import annotations

from pathlib import Path

from train import configs
from train.claims import (
    NOT_TESTABLE,
    Finding,
    Settings,
    claim,
    combine,
    mean_std,
    run_seconds,
)
from train.claims import cache as run_cache
from train.claims.stats import Rule
from train.claims.table import BEATS, LEVEL, compare, compare_runs, compute_hours, run_table

#: LARA's ablations run on ListOps only. The choice was made at v1, where lara stayed at
#: chance on Pathfinder mini; at v2's Pathfinder budget lara learns the task on some seeds
#: (2 of 5 at 8820581, 97.5% and 97.8%), so the ablations could run there too: 4 arms x 5
#: seeds, about 2.8 h of runs more (`compute_hours`; 1.4 h two at a time). They do not, to
#: bound the compute.
ABLATION_TASKS = ("listops",)


@claim(
    "ra.lra",
    paper="RA / LARA",
    statement="RA improves on RFA-style random features on the LRA tasks: it beats performer "
    "and comes close to softmax.",
    experiment="The equal-budget table's `ra` row (S = 1 sample per query, quadratic) against "
    "performer and softmax on each task.",
    rule="Each task: beats performer: "
    + BEATS.text("ra", "performer")
    + " Close to softmax: "
    + LEVEL.text("ra", "softmax")
    + " Combined over tasks and parts: all reproduced -> "
    "reproduced, some -> partly.",
    kind="train",
    compute=f"about {compute_hours(1):.1f} h (the ra arm; RA's step costs about softmax's)",
)
def ra_lra(settings: Settings) -> Finding:
    table = run_table(settings, mechanisms=("softmax", "performer", "rfa", "hedgehog", "ra"))
    n1, v1, p1 = compare(table, "ra", ["performer"])
    n2, v2, p2 = compare(table, "ra", ["softmax"], LEVEL)
    why = (
        "ra draws S = 1 sample per query (`ra`'s default, num_samples=1); the "
        "seed holds only the abstract, so the paper's sample count is not known here. More "
        "samples average out its noise at S times the cost."
    )
    return Finding(f"{n1}; {n2}", combine([v1, v2]), why, {"per": {**p1, **p2}})


def _two_arms(settings: Settings, a: str, b: str, rule: Rule) -> tuple[str, str, dict]:
    """`a` against `b` by `rule` on `ABLATION_TASKS` (`table.compare_runs`)."""
    return compare_runs(settings, ("softmax", a, b), a, [b], rule, ABLATION_TASKS)


@claim(
    "lara.multi_proposal",
    paper="RA / LARA",
    statement="Multiple proposals beat a single proposal in LARA.",
    experiment="Isolated ablation on ListOps (100-250 tokens, the table's budget): lara with "
    "16 proposals x 1 sample against 1 proposal x 16 samples (16 importance-sampling terms "
    "each; all else lara's defaults).",
    rule=BEATS.text("lara_c16_s1", "lara_c1_s16"),
    kind="train",
    compute=f"about {compute_hours(2, ABLATION_TASKS):.1f} h (2 arms x 5 seeds on ListOps)",
)
def lara_multi_proposal(settings: Settings) -> Finding:
    numbers, verdict, data = _two_arms(settings, "lara_c16_s1", "lara_c1_s16", BEATS)
    return Finding(numbers, verdict, "The same 16 terms, split differently.", data)


@claim(
    "lara.decoupled_weights",
    paper="RA / LARA",
    statement="LARA's decoupled, query-dependent importance weights beat coupled weights.",
    experiment="Isolated ablation on ListOps: lara with mis='opt' (the balance heuristic plus "
    "the query-dependent correction, our reading of the decoupled weights) against "
    "mis='bh' (the balance heuristic alone: coupled weights, the same for every query).",
    rule=BEATS.text("lara (mis='opt')", "lara_bh"),
    kind="train",
    compute=f"about {compute_hours(1, ABLATION_TASKS):.1f} h (the lara_bh arm; lara is in the "
    "table)",
)
def lara_decoupled_weights(settings: Settings) -> Finding:
    numbers, verdict, data = _two_arms(settings, "lara", "lara_bh", BEATS)
    why = "The seed holds only the abstract; the mapping of 'decoupled' to mis='opt' is ours."
    return Finding(numbers, verdict, why, data)


@claim(
    "lara.gaussian_vs_mixture",
    paper="RA / LARA",
    statement="A Gaussian proposal does about as well as a mixture.",
    experiment="Isolated ablation on ListOps: lara's Gaussian proposals N(q~_c + k~_c, I) "
    "against mixed=True (each key landmark replaced by a softmax mixture of the key "
    "landmarks, the official '-mixed' proposals).",
    rule=LEVEL.text("lara", "lara_mixed"),
    kind="train",
    compute=f"about {compute_hours(1, ABLATION_TASKS):.1f} h (the lara_mixed arm)",
)
def lara_gaussian_vs_mixture(settings: Settings) -> Finding:
    numbers, verdict, data = _two_arms(settings, "lara", "lara_mixed", LEVEL)
    why = (
        "The seed holds only the abstract; the mixture arm is our reading (the official "
        "'-mixed' proposals), to be checked against the paper's ablation."
    )
    return Finding(numbers, verdict, why, data)


#: byte LM: test loss (nats per byte), lower is better
LM_BEATS = Rule("less", margin=0.01, unit="nats/byte")
LM_CLOSE = Rule("equivalent", margin=0.05, unit="nats/byte")
LM_ARMS = ("softmax", "flexformer_s", "flexformer_n", "performer", "rfa", "hedgehog")
#: an lm mini run (500 steps, batch 32, T = 128, width 128): 185 s on average (132-278 s,
#: 30 runs at 8820581, two at a time on the 2-core CPU; 294 s at 561e076), rounded up
LM_RUN_SECONDS = 200.0


def lm_config(arm: str, seed: int, quick: bool = False):
    """The config of a byte-LM mini run (`train.configs.lm`, the stdlib corpus, offline)."""
    config = configs.get_config("lm", "mini")
    configs.set_attention(config, arm)
    config.seed = seed
    config.progress_bar = False
    if quick:
        configs.apply_overrides(config, ["num_train_steps=4", "data.max_bytes=200000"])
    return config


def lm_dir(settings: Settings, arm: str, seed: int) -> Path:
    return Path(settings.workdir) / "runs" / "lm" / arm / f"seed{seed}"


def lm_run(settings: Settings, arm: str, seed: int) -> dict:
    """One cached byte-LM mini run (`lm_config`)."""
    path = lm_dir(settings, arm, seed)
    return run_cache.trained(lm_config(arm, seed, settings.quick), path, copy=settings.kept(path))


@claim(
    "flexformer.lm",
    paper="Flexformer",
    statement="On byte-level language modelling, the flexformer variants beat the linear "
    "baselines and approach softmax.",
    experiment="`train.configs.lm` mini (the stdlib corpus, context 128, 2 layers, width "
    "128, 500 steps), causal: test loss (nats per byte) of flexformer_s and flexformer_n "
    "against performer, rfa, hedgehog and softmax.",
    rule="Each flexformer variant and baseline: "
    + LM_BEATS.text("its loss", "the baseline's")
    + " Approaches softmax: "
    + LM_CLOSE.text("its loss", "softmax's")
    + " Combined: all "
    "reproduced -> reproduced, some -> partly.",
    kind="train",
    compute=f"about {len(LM_ARMS) * 5 * LM_RUN_SECONDS / 3600:.1f} h ({len(LM_ARMS)} arms x 5 "
    f"seeds at {LM_RUN_SECONDS / 60:.0f} min a run, measured two at a time)",
)
def flexformer_lm(settings: Settings) -> Finding:
    summaries, loss = {}, {}
    for arm in LM_ARMS:
        loss[arm] = []
        for seed in range(settings.seeds):
            s = lm_run(settings, arm, seed)
            summaries[lm_dir(settings, arm, seed)] = s
            loss[arm].append(float(s["test"]["loss"]))
    per, parts = {}, []
    for flex in ("flexformer_s", "flexformer_n"):
        for other, rule in [(b, LM_BEATS) for b in ("performer", "rfa", "hedgehog")] + [
            ("softmax", LM_CLOSE)
        ]:
            per[f"{flex}|{other}"], st = rule.decide(loss[flex], loss[other])
            parts.append(f"{flex} - {other} {rule.summary(st)} -> {per[f'{flex}|{other}']}")
    means = ", ".join(f"{a} {mean_std(v)[0]:.3f} +- {mean_std(v)[1]:.3f}" for a, v in loss.items())
    verdict = combine(per.values()) if per else NOT_TESTABLE
    data = {"loss": loss, "per": per, "train_runs": run_seconds(settings, summaries)}
    return Finding(f"test loss {means}; " + "; ".join(parts), verdict, "", data)
