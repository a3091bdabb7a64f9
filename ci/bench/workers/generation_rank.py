"""One rank of the generation benchmark (launched by ci/bench/generation.py, never by hand).

Every variant builds the same Hugging Face GPT-2 (``transformers.GPT2LMHeadModel`` from a
``GPT2Config``, random weights from a fixed seed, dropout off; nothing is downloaded), gives
each rank the same fixed-length random prompts (a per-rank seed), and decodes greedily a fixed
number of new tokens (``min_new_tokens = max_new_tokens``, so no sequence stops early).

Two phases, timed separately; a call starts after a barrier, so its time on the slowest rank
is the job's:

``generation``  ``--warmup`` untimed then ``--reps`` timed generate calls on the same prompts,
                in eval mode throughout (no training in between: what a pure sampling or
                evaluation loop sees; zero-core's kept units stay gathered across calls)
``rl``          ``--rl-warmup`` + ``--rl-reps`` RL iterations: eval(), generate on new prompts,
                train() (zero-core releases the kept units), one training step (AdamW, language-model loss on the generated part
                of the sequences; the weights change, so the next generate starts over)

Variants (the ``kind`` selects how the model is built, ``how`` how it generates):

    single          plain torch + HF generate, no process group: the bound (each rank is an
                    independent process, as ci/bench/engine.py's compute-only)
    zc-s3           zero-core stage 3, engine.module.generate under torch.no_grad (the
                    generation cache of issue 27, default budget)
    zc-s3-b0        the same with {"generation": {"max_live_parameters": 0}}: every fetch
                    unit gathered again for every token (the old behaviour)
    zc-s3-half      the same with a budget of half the model's elements
    zc-hybrid       zero-core with "hybrid_engine": {"enabled": true}: engine.generate
    zc-gathered     zero_core.gathered_for_generation(engine) (TRL's unwrap pattern)
    zc-zpp-b0       ZeRO++ (zero_quantized_weights + zero_hpz_partition_size = ranks per
                    node) at budget 0;   zc-zpp: the same at the default budget
    ds-module       DeepSpeed ZeRO-3, engine.module.generate under torch.no_grad (its hooks
                    fetch module by module, every token)
    ds-gathered     DeepSpeed ZeRO-3 under deepspeed's unwrap_model_for_generation
                    (GatheredParameters(model.parameters()) with the hooks removed: TRL's)
    ds-hybrid       DeepSpeed's hybrid engine (engine.generate)

The rank reports (``zero_core.testing.ranks.report``) ``status`` ("ok", "unavailable": the
variant could not be set up, with ``error``; "failed": it broke while running), the timed
call seconds (``step_times_s``, ``ledger`` and ``link_tx_bytes`` in ci/bench/cluster.py's
worker protocol, so the same worker runs on the emulated cluster), the RL iterations'
generate and train seconds, the new tokens of the first timed call, the peak resident set of
each phase (VmHWM, reset at the phase start), collectives per phase (zero-core's ledger, or
DeepSpeed's torch.distributed calls counted) and zero-core's memory report.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))  # ci/tools/count_collectives.py

from comm_volume import link_tx_bytes  # noqa: E402
from zero_core.testing.ranks import report  # noqa: E402

# name -> (kind, how it generates, generation budget ("half" = half the model), ZeRO++)
VARIANTS = {
    "single": ("single", "module", None, False),
    "zc-s3": ("zc", "module", None, False),
    "zc-s3-b0": ("zc", "module", 0, False),
    "zc-s3-half": ("zc", "module", "half", False),
    "zc-hybrid": ("zc", "engine", None, False),
    "zc-gathered": ("zc", "gathered", None, False),
    "zc-zpp-b0": ("zc", "module", 0, True),
    "zc-zpp": ("zc", "module", None, True),
    "ds-module": ("ds", "module", None, False),
    "ds-gathered": ("ds", "gathered", None, False),
    "ds-hybrid": ("ds", "engine", None, False),
}


class Unavailable(Exception):
    """The variant cannot be set up here (a feature missing, a peer that refuses the CPU)."""


# ---------------------------------------------------------------- measuring

def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark since the last reset (VmHWM)."""
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmHWM:\s+(\d+)", fh.read()).group(1)) * 1024


def reset_peak_rss() -> None:
    """Start a new high-water mark (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass  # then the peak is since the process started


def count_torch_collectives(counts: dict, phase: list) -> None:
    """Count DeepSpeed's torch.distributed calls per phase (must run before deepspeed is
    imported): ci/tools/count_collectives.py's wrapper."""
    from count_collectives import count_deepspeed_calls
    count_deepspeed_calls(counts, phase)


# ---------------------------------------------------------------- the model

def build_model(a):
    from transformers import GPT2Config, GPT2LMHeadModel
    eos = a.vocab - 1
    cfg = GPT2Config(vocab_size=a.vocab, n_positions=max(64, a.prompt_len + a.new_tokens),
                     n_embd=a.width, n_layer=a.layers, n_head=a.heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(a.seed)
    model = GPT2LMHeadModel(cfg)
    model.generation_config.pad_token_id = eos
    return model


def prompts(a, rank: int, call: int):
    """Fixed-length random prompts of this rank for generate call *call* (-1: the
    generation phase's prompts, the same for every call)."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + call)
    return torch.randint(0, a.vocab - 1, (a.batch, a.prompt_len), generator=g)


def gen_kwargs(a, ids) -> dict:
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, use_cache=True,
                pad_token_id=a.vocab - 1)


def labels_for(seqs, prompt_len: int):
    """Language-model labels on the generated part only (HF shifts them inside)."""
    labels = seqs.clone()
    labels[:, :prompt_len] = -100
    return labels


# ---------------------------------------------------------------- the variants

def engine_train_step(engine, seqs, prompt_len) -> float:
    """One training step through a DeepSpeed-style engine (zero-core's and DeepSpeed's share
    the API): LM loss on the generated tokens, backward, step."""
    loss = engine(input_ids=seqs, labels=labels_for(seqs, prompt_len)).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


class Single:
    """Plain torch: the whole model in this process, no process group."""

    def __init__(self, a, model):
        self.dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
        self.model = model.to(self.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=0.0)
        self.rank = int(os.environ.get("RANK", "0"))

    def generate(self, kw):
        with torch.no_grad():
            return self.model.generate(**kw)

    def mode(self, training: bool):
        self.model.train(training)

    def train_step(self, seqs, prompt_len):
        loss = self.model(input_ids=seqs, labels=labels_for(seqs, prompt_len)).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)

    def barrier(self):
        pass

    def comm_mark(self, phase):
        return None

    def comm_since(self, mark):
        return None

    def memory(self):
        return None

    def close(self):
        pass


class ZeroCore:
    """zero-core's stage-3 engine (contract of issue 27)."""

    def __init__(self, a, model, variant):
        import zero_core
        _, self.how, budget, zeropp = VARIANTS[variant]
        self.zc = zero_core
        numel = sum(p.numel() for p in model.parameters())
        rpn = int(os.environ.get("ZERO_CORE_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE", "1"))
        zero = {"stage": 3}
        cfg = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.0}},
               "zero_optimization": zero}
        if a.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if budget is not None:
            cfg["generation"] = {"max_live_parameters": numel // 2 if budget == "half" else budget}
        if zeropp:
            zero.update(zero_quantized_weights=True, zero_hpz_partition_size=rpn)
        if self.how == "engine":
            cfg["hybrid_engine"] = {"enabled": True, "release_inference_cache": a.release_cache}
        if self.how == "gathered" and not hasattr(zero_core, "gathered_for_generation"):
            raise Unavailable("zero_core.gathered_for_generation does not exist")
        try:
            self.engine, *_ = zero_core.initialize(model=model, config=cfg)
        except Exception as exc:
            raise Unavailable(f"zero_core.initialize: {type(exc).__name__}: {exc}") from exc
        if self.how == "engine" and not hasattr(self.engine, "generate"):
            raise Unavailable(f"{type(self.engine).__name__}.generate does not exist")
        self.rank = self.engine.global_rank
        self.ledger = self.engine.comm.ledger

    def generate(self, kw):
        e = self.engine
        if self.how == "engine":
            return e.generate(**kw)
        if self.how == "gathered":
            with self.zc.gathered_for_generation(e) as model, torch.no_grad():
                return model.generate(**kw)
        with torch.no_grad():
            return e.module.generate(**kw)

    def mode(self, training: bool):
        self.engine.train(training)   # train() releases the kept units, eval() keeps them

    def train_step(self, seqs, prompt_len):
        return engine_train_step(self.engine, seqs, prompt_len)

    def barrier(self):
        self.engine.comm.barrier()

    def comm_mark(self, phase):
        return self.ledger.snapshot()

    def comm_since(self, mark):
        diff = self.ledger.difference(self.ledger.snapshot(), mark)
        return diff

    def memory(self):
        rep = self.engine.memory_report()
        keep = {k: v for k, v in rep.items() if k in ("stage3", "zeropp", "num_parameters")
                or "generat" in k or "hybrid" in k}
        keep["ledger"] = rep.get("ledger")
        return keep

    def close(self):
        from zero_core.testing.ranks import leave_rank
        self.engine.destroy()
        leave_rank()


class DeepSpeed:
    """DeepSpeed's ZeRO-3 (DS_ACCELERATOR=cpu, gloo), torch's AdamW as in the other benches."""

    def __init__(self, a, model, variant):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.how = VARIANTS[variant][1]
        self.counts = collections.defaultdict(lambda: [0, 0])
        self.phase = ["init"]
        count_torch_collectives(self.counts, self.phase)
        import deepspeed
        import torch.distributed as dist
        deepspeed.init_distributed(dist_backend="gloo")
        self.dist = dist
        config = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
                  "steps_per_print": 10**9}
        if a.precision == "bf16":
            config["bf16"] = {"enabled": True}
        if self.how == "engine":
            config["hybrid_engine"] = {"enabled": True, "max_out_tokens": a.prompt_len + a.new_tokens,
                                       "inference_tp_size": 1, "pin_parameters": True,
                                       "release_inference_cache": a.release_cache,
                                       "tp_gather_partition_size": 8}
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
        try:
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        except Exception as exc:
            raise Unavailable(f"deepspeed.initialize: {type(exc).__name__}: {exc}") from exc
        if self.how == "gathered":
            from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
            self.unwrap = unwrap_model_for_generation
        self.rank = dist.get_rank()

    def generate(self, kw):
        e = self.engine
        if self.how == "engine":
            return e.generate(**kw)
        if self.how == "gathered":
            with self.unwrap(e) as unwrapped, torch.no_grad():
                return unwrapped.module.generate(**kw)
        with torch.no_grad():
            return e.module.generate(**kw)

    def mode(self, training: bool):
        self.engine.train(training)

    def train_step(self, seqs, prompt_len):
        return engine_train_step(self.engine, seqs, prompt_len)

    def barrier(self):
        self.dist.barrier()

    def comm_mark(self, phase):
        self.phase[0] = phase
        return {k: list(v) for k, v in self.counts.items()}

    def comm_since(self, mark):
        ops = {}
        for (phase, name), (calls, nbytes) in self.counts.items():
            if phase != self.phase[0]:
                continue
            c0, b0 = mark.get((phase, name), (0, 0))
            if calls - c0:
                ops[name] = {"calls": calls - c0, "payload_bytes": nbytes - b0}
        return {"ops": ops, "counted": "torch.distributed calls (input bytes)"}

    def memory(self):
        return None

    def close(self):
        self.dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def gather_summary(diff, per: int) -> dict | None:
    """Parameter-gathering collectives (all-gathers, broadcasts) and everything sent, divided
    by *per* (decode steps for generation, iterations for RL)."""
    if diff is None:
        return None
    ag = {op: d for op, d in diff["ops"].items() if "gather" in op or "broadcast" in op}
    out = {"gather_calls": sum(d["calls"] for d in ag.values()) / per,
           "gather_payload_bytes": sum(d.get("payload_bytes", 0) for d in ag.values()) / per,
           "calls": sum(d["calls"] for d in diff["ops"].values()) / per}
    if "sent_bytes" in diff:
        out["sent_bytes"] = diff["sent_bytes"] / per
        out["inter_node_bytes"] = diff["inter_node_bytes"] / per
    return out


# ---------------------------------------------------------------- the phases

def run(a, v) -> dict:
    out = {"generation": {}, "rl": {}}
    rank = v.rank
    kw = gen_kwargs(a, prompts(a, rank, -1))
    # generation: the same prompts every call, nothing trained in between
    reset_peak_rss()
    v.mode(False)   # eval once: back-to-back calls, as a sampling or evaluation loop makes them
    times, cpu, tokens = [], [], None
    for i in range(a.warmup + a.reps):
        if i == a.warmup:
            v.barrier()
            mark, link0 = v.comm_mark("generation"), link_tx_bytes()
        v.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        seqs = v.generate(kw)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= a.warmup:
            times.append(dt)
            cpu.append(dc)
            if tokens is None:
                tokens = seqs[:, a.prompt_len:].tolist()
        print(f"[rank {rank}] generate {i + 1}/{a.warmup + a.reps}: {dt:.2f} s", flush=True)
    v.barrier()
    diff, link1 = v.comm_since(mark), link_tx_bytes()
    out.update(step_times_s=times, ledger=diff if diff and "sent_bytes" in diff else None,
               link_tx_bytes=(link1 - link0 if None not in (link0, link1)
                              and os.environ.get("LOCAL_RANK", "0") == "0" else None))
    out["generation"] = {"call_s": times, "cpu_s": cpu, "tokens": tokens, "peak_rss_bytes": peak_rss_bytes(),
                         "per_token": gather_summary(diff, len(times) * a.new_tokens),
                         "memory": v.memory()}
    # RL iterations: generate on new prompts, then one training step on what was generated
    if a.rl_reps:
        reset_peak_rss()
        rl = {"gen_s": [], "train_s": [], "iter_s": [], "cpu_s": [], "losses": []}
        for i in range(a.rl_warmup + a.rl_reps):
            if i == a.rl_warmup:
                v.barrier()
                mark = v.comm_mark("rl")
            v.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            v.mode(False)
            seqs = v.generate(gen_kwargs(a, prompts(a, rank, i)))
            t1 = time.perf_counter()
            v.mode(True)
            loss = v.train_step(seqs, a.prompt_len)
            t2, c2 = time.perf_counter(), time.process_time()
            print(f"[rank {rank}] RL iteration {i + 1}/{a.rl_warmup + a.rl_reps}: generate "
                  f"{t1 - t0:.2f} s, train {t2 - t1:.2f} s, loss {loss:.3f}", flush=True)
            rl["losses"].append(loss)
            if i >= a.rl_warmup:
                for key, val in (("gen_s", t1 - t0), ("train_s", t2 - t1), ("iter_s", t2 - t0),
                                 ("cpu_s", c2 - c0)):
                    rl[key].append(val)
        v.barrier()
        diff = v.comm_since(mark)
        rl.update(peak_rss_bytes=peak_rss_bytes(),
                  per_iteration=gather_summary(diff, a.rl_reps), memory=v.memory())
        out["rl"] = rl
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=12000)
    p.add_argument("--batch", type=int, default=4, help="prompts per rank")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", "--steps", dest="reps", type=int, default=3)
    p.add_argument("--rl-warmup", type=int, default=1)
    p.add_argument("--rl-reps", type=int, default=3, help="timed RL iterations (0: none)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--release-cache", action="store_true",
                   help="hybrid_engine.release_inference_cache (default false, DeepSpeed's)")
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    kind = VARIANTS[a.variant][0]
    model = build_model(a)
    base = {"variant": a.variant, "precision": a.precision, "torch": torch.__version__,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "rank": int(os.environ.get("RANK", "0")),
            "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    try:
        v = {"single": Single, "zc": ZeroCore, "ds": DeepSpeed}[kind](
            a, model, *(() if kind == "single" else (a.variant,)))
    except Unavailable as exc:
        report({**base, "status": "unavailable", "error": str(exc),
                "traceback": traceback.format_exc()[-3000:]})
        traceback.print_exc()
        os._exit(0)
    except Exception as exc:  # noqa: BLE001 - any set-up failure makes the row n/a
        report({**base, "status": "unavailable", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:]})
        traceback.print_exc()
        os._exit(0)
    try:
        res = run(a, v)
    except Exception as exc:  # noqa: BLE001 - reported, then the job fails
        report({**base, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:]})
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    report({**base, "status": "ok", **res})
    v.close()


if __name__ == "__main__":
    main()
