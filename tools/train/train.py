#!/usr/bin/env python3
"""Trains the DFlash2 drafter and the MTP head for SmolLM2-135M-Instruct; one call is one run of a resumable series.

A run trains on the samples generate.py made for it (fresh data every run) for a number of steps of a schedule
defined over the whole series (--total-steps; the learning rate depends on the global step only), then
evaluates on the held-out splits and writes to --out:
    train_state.pt   exact checkpoint (f32 weights, whole optimizer state): stays on the machine that trained
    resume.pt        compact checkpoint (bf16 weights, 8-bit second moment): travels; --resume takes either
    metrics.jsonl    one line per run of the series so far (steps, tokens, anchors, loss curve, acceptance)
    metrics.json     this run's line plus the checkpoint's configuration (read by export.py)
Losses, masks and the teacher: distill.py; the loop: trainer.py; checkpoints and the schedule: checkpoint.py.

    python tools/train/train.py --data RUN/data/samples.npz --out RUN/ckpt --total-steps 20000     # first run
    python tools/train/train.py --data RUN2/data/samples.npz --out RUN2/ckpt --resume RUN/ckpt/resume.pt
    python tools/train/train.py --smoke --data /tmp/smoke/samples.npz --out /tmp/smoke/ckpt          # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import checkpoint as ckpt
import distill
import drafter as dfl
import mtp as mtp_mod
import tiny_target
from export import read_drafter, read_mtp
from target import DEFAULT_GGUF, TargetConfig, configure_torch, load_target
from train_data import data_id, load_samples, split_indices, token_counts, trim_repeats
from train_eval import evaluate
from trainer import TrainConfig, Trainer

MASK_TOKEN = "<empty_output>"  # a control token that chat never produces; its embedding row fills masked slots


def log(msg: str) -> None:
    print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="samples .npz from generate.py")
    p.add_argument("--gguf", type=Path, default=None, help=f"the target (default {DEFAULT_GGUF})")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--resume", type=Path, help="a checkpoint of the previous run (train_state.pt or resume.pt)")
    p.add_argument("--init-drafter", type=Path,
                   help="start a new series from an exported drafter folder (its config and weights; e.g. the "
                        "shipped assets/drafters/smollm2-135m-instruct): the optimizer starts afresh")
    p.add_argument("--init-mtp", type=Path, help="with --init-drafter: the exported MTP head folder to start from")
    g = p.add_argument_group("capacity (a fresh series only; a resumed one keeps its checkpoint's)")
    g.add_argument("--layers", type=int, default=3)
    g.add_argument("--intermediate", type=int, default=1536, help="drafter MLP width (the target's: 1536)")
    g.add_argument("--num-taps", type=int, default=6, help="target layers tapped, spread by the reference rule")
    g.add_argument("--taps", default="", help="explicit tap layers, comma-separated (overrides --num-taps)")
    g.add_argument("--block-size", type=int, default=8)
    g.add_argument("--conv-kernel", type=int, default=2)
    g.add_argument("--conv-group", type=int, default=16)
    g.add_argument("--selector-rank", type=int, default=24)
    g.add_argument("--selector-top-k", type=int, default=16)
    g.add_argument("--no-mtp", action="store_true")
    g = p.add_argument_group("losses")
    g.add_argument("--loss", default="kd", choices=("kd", "ce", "kd+ce"))
    g.add_argument("--kd-top-k", type=int, default=32, help="teacher tokens kept per position (0: dense KL)")
    g.add_argument("--ce-weight", type=float, default=0.1, help="CE weight in kd+ce")
    g.add_argument("--loss-gamma", type=float, default=4.0, help="slot weight exp(-(k-1)/gamma)")
    g.add_argument("--selector-alpha", type=float, default=0.5, help="selector loss weight after its ramp")
    g.add_argument("--mtp-weights", default="1.0,0.5", help="MTP loss weight per chained depth")
    g.add_argument("--mtp-loss-weight", type=float, default=1.0)
    g.add_argument("--target-precision", default="f32", choices=("f32", "tf32", "bf16"),
                   help="the target's pass (labels and taps); f32 runs with TF32 off")
    g = p.add_argument_group("batches and optimizer")
    g.add_argument("--trim-repeats", type=int, default=None,
                   help="cut training responses after their first repeated run of this many tokens (0: keep loops; "
                        "a new series 32, a resumed one its checkpoint's, so its data cursor still fits)")
    g.add_argument("--anchors-per-seq", type=int, default=256)
    g.add_argument("--batch-tokens", type=int, default=16384, help="padded sequence tokens per step")
    g.add_argument("--batch-anchors", type=int, default=4096, help="anchored blocks per step")
    g.add_argument("--lr", type=float, default=8e-4)
    g.add_argument("--min-lr-ratio", type=float, default=0.05)
    g.add_argument("--warmup-steps", type=int, default=300)
    g.add_argument("--schedule", default="wsd", choices=("wsd", "cosine"))
    g.add_argument("--decay-frac", type=float, default=0.25, help="wsd: the final share of steps that decays")
    g.add_argument("--total-steps", type=int, default=0,
                   help="steps of the whole series (required for a fresh series; on resume, changes it)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g = p.add_argument_group("this run")
    g.add_argument("--steps", type=int, default=0, help="steps in this run at most (0: until the time budget)")
    g.add_argument("--time-budget-s", type=float, default=float("inf"), help="whole script, loading included")
    g.add_argument("--eval-reserve-s", type=float, default=60.0, help="budget kept for the final evaluation")
    g.add_argument("--eval-every-s", type=float, default=300.0, help="quick held-out evaluation this often")
    g.add_argument("--eval-quick", type=int, default=32, help="held-out samples in a quick evaluation")
    g.add_argument("--eval-max", type=int, default=192, help="held-out samples in the final evaluation")
    g.add_argument("--ckpt-every-s", type=float, default=600.0, help="exact checkpoint this often")
    g.add_argument("--curve-every", type=int, default=50, help="loss-curve sample every N steps")
    g.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many steps once warm (torch.profiler table; they train as usual)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--smoke", action="store_true", help="tiny drafter, a few steps, CPU, tiny random target")
    args = p.parse_args(argv)
    if args.init_mtp is not None and args.init_drafter is None:
        p.error("--init-mtp goes with --init-drafter (a series starts from both, or from a checkpoint)")
    if args.smoke:
        args.device, args.layers, args.intermediate, args.num_taps = "cpu", 1, 64, 2
        args.selector_rank, args.selector_top_k, args.anchors_per_seq, args.kd_top_k = 8, 4, 8, 8
        args.batch_tokens, args.batch_anchors, args.steps = 512, 32, args.steps or 3
        args.warmup_steps, args.total_steps = 2, args.total_steps or 12
        args.eval_max, args.eval_quick, args.eval_reserve_s, args.eval_every_s = 2, 2, 0.0, 0.0
        args.curve_every = 1
    if args.gguf is None:
        args.gguf = tiny_target.ensure() if args.smoke else DEFAULT_GGUF
    return args


def fresh_configs(args, cfg: TargetConfig, mask_id: int, draft_cfg: dict | None = None) -> dict:
    """The drafter config (draft_cfg when the series starts from exported weights), MTP switch and schedule of a
    new series."""
    if args.total_steps <= 0:
        raise SystemExit("a fresh series needs --total-steps (the schedule spans all its runs)")
    sched = ckpt.schedule_config(args.schedule, args.total_steps, args.warmup_steps, args.decay_frac, args.lr,
                                 args.min_lr_ratio)
    trim = 32 if args.trim_repeats is None else args.trim_repeats
    depth_weights = [float(w) for w in args.mtp_weights.split(",")]
    if draft_cfg is not None:
        return {"drafter_config": draft_cfg, "schedule": sched, "mtp": not args.no_mtp,
                "mtp_depth_weights": depth_weights, "runs": [], "token_counts": None, "trim_repeats": trim}
    taps = [int(t) for t in args.taps.split(",")] if args.taps else dfl.build_target_layer_ids(cfg.num_layers,
                                                                                               args.num_taps)
    draft_cfg = dfl.draft_config(cfg, layers=args.layers, intermediate_size=args.intermediate,
                                 block_size=args.block_size, mask_token_id=mask_id,
                                 conv_kernel_size=args.conv_kernel, conv_group_size=args.conv_group,
                                 selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                                 target_layer_ids=taps)
    return {"drafter_config": draft_cfg, "schedule": sched, "mtp": not args.no_mtp,
            "mtp_depth_weights": depth_weights, "runs": [], "token_counts": None, "trim_repeats": trim}


def resumed_configs(args, state: dict, cfg: TargetConfig) -> dict:
    if state["target_config"]["num_layers"] != cfg.num_layers or state["target_config"]["hidden_size"] != \
            cfg.hidden_size:
        raise SystemExit("the checkpoint was trained for another target")
    sched = dict(state["schedule"])
    kept = ", ".join(f"{k} {sched[k]}" for k in ("kind", "warmup_steps", "decay_frac", "peak_lr") if k in sched)
    log(f"schedule kept from the checkpoint ({kept}): --warmup-steps, --decay-frac, --lr and --schedule apply to a "
        "fresh series only")
    if args.total_steps > 0 and args.total_steps != sched["total_steps"]:
        log(f"schedule: total steps {sched['total_steps']} -> {args.total_steps}")
        sched["total_steps"] = args.total_steps
    # The data cursor and the token counts know the data by its sequences' lengths, which trimming changes: a
    # resumed series keeps its trim window (none before checkpoints recorded one).
    trim = int(state.get("trim_repeats", 0))
    if args.trim_repeats is not None and args.trim_repeats != trim:
        raise SystemExit(f"the checkpoint's series trims repeats at {trim} tokens, not {args.trim_repeats}")
    return {"drafter_config": state["drafter_config"], "schedule": sched, "mtp": state["mtp_state"] is not None,
            "mtp_depth_weights": state["mtp_depth_weights"], "runs": list(state.get("runs", [])),
            "token_counts": state.get("token_counts"), "trim_repeats": trim}


def build_models(conf: dict, target, cfg: TargetConfig, state: dict | None, seed: int, device):
    drafter = dfl.make_drafter(conf["drafter_config"], seed)
    head = mtp_mod.MtpHead(cfg) if conf["mtp"] else None
    if head is not None:
        mtp_mod.init_from_target(head, target, seed)
    if state is not None:
        drafter.load_state_dict({k: v.float() for k, v in state["drafter_state"].items()})
        if head is not None and state["mtp_state"] is not None:
            head.load_state_dict({k: v.float() for k, v in state["mtp_state"].items()})
    return drafter.to(device), None if head is None else head.to(device)


def train_config(args, conf: dict, pad_id: int) -> TrainConfig:
    d = conf["drafter_config"]["dflash_config"]
    return TrainConfig(
        block_size=d["block_size"], target_layer_ids=list(d["target_layer_ids"]), mask_token_id=d["mask_token_id"],
        selector_top_k=d["selector_top_k"], pad_id=pad_id, schedule=conf["schedule"],
        loss=distill.LossConfig(args.loss, args.kd_top_k, args.ce_weight), loss_gamma=args.loss_gamma,
        selector_alpha=args.selector_alpha, mtp_weights=conf["mtp_depth_weights"],
        mtp_loss_weight=args.mtp_loss_weight, anchors_per_seq=args.anchors_per_seq, batch_tokens=args.batch_tokens,
        batch_anchors=args.batch_anchors, weight_decay=args.weight_decay, seed=args.seed,
        target_precision=args.target_precision)


def eval_options(tc: TrainConfig, smoke: bool) -> dict:
    return {"block_size": tc.block_size, "target_layer_ids": tc.target_layer_ids, "mask_token_id": tc.mask_token_id,
            "selector_top_k": tc.selector_top_k, "loss_gamma": tc.loss_gamma, "mtp_weights": tc.mtp_weights,
            "pad_id": tc.pad_id, "loss": tc.loss, "eval_batch": 2 if smoke else 8,
            "eval_anchor_chunk": 16 if smoke else 128}


def quick_eval_line(metrics: dict) -> str:
    walk, mtp = metrics["dflash_greedy_walk"], metrics["mtp_greedy"] or {}
    first, mtp_first = metrics["dflash_greedy_walk_first"], metrics["mtp_greedy_first"] or {}
    return (f"held-out: dflash2 {walk.get('tokens_per_round')} tokens/round {walk.get('per_position')}; mtp "
            f"{mtp.get('tokens_per_round')} tokens/round {mtp.get('per_position')}; first {metrics['first_tokens']} "
            f"tokens: dflash2 {first.get('tokens_per_round')} {first.get('per_position')}, mtp "
            f"{mtp_first.get('tokens_per_round')}; token loss {metrics['token_loss']}")


def make_hooks(args, trainer_eval, save_exact):
    """Quick evaluation and exact checkpoints at wall-clock intervals (they do not change the training)."""
    last = {"eval": time.time(), "ckpt": time.time()}

    def hook(trainer, now):
        if args.eval_every_s and now - last["eval"] > args.eval_every_s:
            last["eval"] = now
            log(quick_eval_line(trainer_eval("heldout", args.eval_quick)))
        if args.ckpt_every_s and now - last["ckpt"] > args.ckpt_every_s:
            last["ckpt"] = now
            log(f"exact checkpoint at step {trainer.step}: {save_exact() / 2**20:.1f} MiB")

    return [hook]


def initial_weights(args, state: dict | None, cfg: TargetConfig) -> tuple[dict, dict]:
    """(drafter config, {drafter_state, mtp_state}) of a series that starts from exported weights; an MTP head
    not given starts as a copy of the target's last layer, as in any new series."""
    if state is not None:
        raise SystemExit("--init-drafter starts a new series; --resume continues one: give one of them")
    if args.init_mtp is not None and args.no_mtp:
        raise SystemExit("--init-mtp and --no-mtp contradict each other")
    draft_cfg, draft_state = read_drafter(args.init_drafter)
    if draft_cfg.get("num_target_layers") != cfg.num_layers or draft_cfg.get("hidden_size") != cfg.hidden_size:
        raise SystemExit(f"{args.init_drafter} was trained for another target")
    mtp_state = None
    if args.init_mtp is not None:
        mtp_state = read_mtp(args.init_mtp)
        mtp_cfg = json.loads((args.init_mtp / "config.json").read_text(encoding="utf-8"))
        if mtp_cfg.get("hidden_size") != cfg.hidden_size:
            raise SystemExit(f"{args.init_mtp} was trained for another target")
    return draft_cfg, {"drafter_state": draft_state, "mtp_state": mtp_state}


def setup(args, device):
    """Samples, target, the series' configuration (fresh or from --resume) and a trainer ready to step."""
    samples = load_samples(args.data)
    cfg, target, tokenizer = load_target(args.gguf, device)
    state = ckpt.load(args.resume) if args.resume else None
    init = None
    if args.init_drafter is not None:
        draft_cfg, init = initial_weights(args, state, cfg)
        conf = fresh_configs(args, cfg, tokenizer.token_to_id(MASK_TOKEN), draft_cfg)
    elif state is not None:
        conf = resumed_configs(args, state, cfg)
    else:
        conf = fresh_configs(args, cfg, tokenizer.token_to_id(MASK_TOKEN))
    drafter, head = build_models(conf, target, cfg, state or init, args.seed, device)
    tc = train_config(args, conf, cfg.eos_id)
    splits = split_indices(samples)
    if conf["trim_repeats"]:
        cut, removed = trim_repeats(samples, splits["train"], conf["trim_repeats"])
        log(f"trimmed {cut} training responses after a repeated {conf['trim_repeats']}-token run: {removed} tokens")
        splits = split_indices(samples)
    trainer = Trainer(target, drafter, head, tc, samples, splits["train"], device, resume=state)
    return samples, cfg, target, conf, trainer, splits


def run(args) -> dict:
    started = time.time()
    device = torch.device(args.device)
    configure_torch(device, args.smoke, tf32=False)
    torch.manual_seed(args.seed)
    samples, cfg, target, conf, trainer, splits = setup(args, device)
    drafter, head, tc = trainer.drafter, trainer.head, trainer.cfg
    opts = eval_options(tc, args.smoke)
    run_index = len(conf["runs"]) + 1
    log(f"run {run_index}: {len(samples)} samples ({len(splits['train'])} train, {len(splits['heldout'])} held-out, "
        f"{len(splits['bench'])} bench); drafter {dfl.param_count(drafter) / 1e6:.2f} M params, taps "
        f"{tc.target_layer_ids}; MTP {0 if head is None else dfl.param_count(head) / 1e6:.2f} M params; step "
        f"{trainer.step} of {tc.schedule['total_steps']}; setup {time.time() - started:.1f} s")

    def trainer_eval(split: str, limit: int) -> dict:
        return evaluate(target, drafter, head, samples, splits[split][:limit], opts, device)

    def full_state() -> dict:
        return {**trainer.checkpoint_state(), **static_state(args, conf, cfg, samples, splits)}

    def save_exact() -> int:
        return ckpt.save(args.out / "train_state.pt", full_state(), compact=False)

    loop_start, first_step = time.time(), trainer.step
    deadline = started + args.time_budget_s - args.eval_reserve_s
    curve = trainer.run(args.steps or 1 << 62, deadline, args.curve_every, log,
                        make_hooks(args, trainer_eval, save_exact), args.profile_steps)
    train_seconds = time.time() - loop_start
    log(f"trained steps {first_step}..{trainer.step} in {train_seconds:.0f} s; evaluating")
    evals = {name: trainer_eval(name, args.eval_max if name == "heldout" else len(splits[name]))
             for name in ("heldout", "bench") if splits[name]}
    for name, metrics in evals.items():
        log(f"{name}: {quick_eval_line(metrics)}")
    summary = run_summary(run_index, samples, trainer, first_step, curve, evals, train_seconds, args, device)
    conf["runs"].append(summary)
    final = full_state()
    sizes = {"train_state.pt": ckpt.save(args.out / "train_state.pt", final, compact=False),
             "resume.pt": ckpt.save(args.out / "resume.pt", final, compact=True)}
    log(f"checkpoints: {', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in sizes.items())}")
    write_metrics(args.out, conf["runs"], final)
    log(f"done in {time.time() - started:.0f} s")
    return summary


def static_state(args, conf: dict, cfg: TargetConfig, samples, splits) -> dict:
    """The parts of a checkpoint that do not change during a run: configs, token counts, run summaries."""
    if "counts" not in conf:
        previous = conf["token_counts"]
        counted = list(previous.get("data_ids", [])) if previous else []
        if data_id(samples) in counted:  # resumed from a checkpoint written earlier in this very run
            conf["counts"] = previous
        else:
            response, prompt = token_counts(samples, splits["train"], cfg.vocab_size)
            if previous is not None:
                response, prompt = response + previous["response"].numpy(), prompt + previous["prompt"].numpy()
            conf["counts"] = {"response": torch.from_numpy(response), "prompt": torch.from_numpy(prompt),
                              "data_ids": counted + [data_id(samples)]}
    last = conf["runs"][-1] if conf["runs"] else {}
    return {
        "drafter_config": conf["drafter_config"],
        "mtp_depth_weights": conf["mtp_depth_weights"],
        "target": {"gguf": args.gguf.name, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size},
        "target_config": cfg.__dict__,
        "token_counts": conf["counts"],
        "runs": conf["runs"],
        "trim_repeats": conf["trim_repeats"],
        "metrics": last.get("eval", {}).get("heldout", {}),
        "data": last.get("data"),
        "args": last.get("args"),
    }


def run_summary(run_index, samples, trainer, first_step, curve, evals, seconds, args, device) -> dict:
    steps_done = trainer.step - first_step
    info = samples.info
    return {
        "run": run_index,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "data": {k: info.get(k) for k in ("samples", "shard", "num_shards", "seed", "variants", "max_new_tokens",
                                          "response_tokens", "greedy_response_tokens", "prompt_tokens", "seconds",
                                          "tokens_per_second", "prompts_sha256_jsonl", "gguf_sha256", "splits")},
        "steps": {"start": first_step, "end": trainer.step, "total": trainer.cfg.schedule["total_steps"]},
        # The schedule the steps ran on: a resumed run keeps its checkpoint's, whatever "args" below says.
        "schedule": dict(trainer.cfg.schedule),
        "train_seconds": round(seconds, 1),
        "steps_per_second": round(steps_done / max(seconds, 1e-9), 3),
        "trained": dict(trainer.totals),
        "epochs_over_data": round(trainer.cursor.epochs_done(), 3),
        "lr_last": curve[-1]["lr"] if curve else None,
        "loss_curve": curve,
        "eval": evals,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def write_metrics(out: Path, runs: list[dict], state: dict) -> None:
    """metrics.jsonl: every run of the series (committed beside the shipped weights); metrics.json: the last."""
    out.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, sort_keys=True) + "\n" for r in runs)
    (out / "metrics.jsonl").write_text(lines, encoding="utf-8")
    last = {"run": runs[-1], "drafter_config": state["drafter_config"], "schedule": state["schedule"],
            "step": state["step"]}
    (out / "metrics.json").write_text(json.dumps(last, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    run(parse_args())


if __name__ == "__main__":
    main()
