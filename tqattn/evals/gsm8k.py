"""Few-shot accuracy through the engine, gated by YAML configs: GSM8K-style word problems
(vLLM's gate) and short arithmetic (a gate the small shipped models can pass).

A config (tqattn/configs/evals/*.yaml, or any path) names the model, the KV-cache preset, engine
arguments, the data and the pass rule; see `GSMConfig` and the shipped files for the schema.
Decoding is greedy. The task follows from the data source:

* gsm_symbolic / jsonl: exemplars are worked gsm_symbolic solutions ("Question: ...\nAnswer:
  <steps>\n#### N") drawn with a seed different from the questions'; decoding stops at the
  next "Question:".
* chain_sum: "Question: 4 - 7 =\nAnswer: The result is -3." exemplars, then the question; the
  answer counts only when the model writes "The result is N". The number is therefore never
  the prefill's own next token: it comes from a decode step, after three generated tokens,
  and every key and value that step reads — the question's included — comes from the cache.
  That is what makes it a gate on the cache (a prompt-final answer would be computed from the
  prompt's raw K/V).

The pass rule is accuracy >= threshold - tolerance and/or accuracy >= (accuracy of the same
config with kv_cache_dtype "auto" on the same problems, run first) - max_drop. Tolerances may be
given in standard deviations instead (`tolerance_sigmas`, `max_drop_sigmas`): they are then
derived from the number of problems (`sigma_tolerance`, `sigma_max_drop`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from . import data as evdata
from . import scoring

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- answer extraction

# A sign counts only when no digit or letter precedes it ("10-3" is not "10" and "-3").
_NUM = r"(?<![\w.])(?P<sign>[-−])?\s*[$€£]?\s*(?P<sign2>[-−])?(?P<num>\d(?:[\d,]*\d)?(?:\.\d+)?)"
_MARKERS = (
    re.compile(r"####\s*\**\s*" + _NUM),
    re.compile(r"\\boxed\{\s*" + _NUM),
    re.compile(r"answer\s+is\s*:?\s*\**\s*" + _NUM, re.IGNORECASE),
)
_ANY_NUM = re.compile(_NUM)


def _number(m: re.Match) -> float:
    value = float(m.group("num").replace(",", ""))
    return -value if (m.group("sign") or m.group("sign2")) else value


def extract_answer(text: str) -> float | None:
    """The final answer in a model's solution: the first "#### N", else "\\boxed{N}", else
    "the answer is N", else the last number; None when there is no number at all.

    Commas, currency signs and markdown bold are ignored; "−" counts as a minus sign.
    """
    for pattern in _MARKERS:
        m = pattern.search(text)
        if m:
            return _number(m)
    last = None
    for last in _ANY_NUM.finditer(text):
        pass
    return _number(last) if last else None


def is_correct(pred: float | None, gold: int | float) -> bool:
    return pred is not None and abs(pred - gold) < 1e-6


# ----------------------------------------------------------------------------- prompts

INSTRUCTION = ("Solve each math word problem. Show the calculation one step per line, then write "
               "the final answer as a plain number after \"####\".")
STOP = ["Question:", "\n\n\n"]
_RESULT = re.compile(r"The result is\s*" + _NUM)


def format_solution(item: evdata.GSMItem) -> str:
    return f"{item.cot}\n#### {item.answer}"


def extract_result(text: str) -> float | None:
    """The N of the first "The result is N" in an arithmetic answer, else None."""
    m = _RESULT.search(text)
    return _number(m) if m else None


@dataclass(frozen=True)
class Task:
    """How a data source's items are asked and answered."""
    instruction: str | None              # the first prompt block / system message
    stop: tuple[str, ...]
    question: Callable[[evdata.GSMItem], str]
    solution: Callable[[evdata.GSMItem], str]
    extract: Callable[[str], float | None]


GSM = Task(INSTRUCTION, tuple(STOP), lambda it: it.question, format_solution, extract_answer)
ARITH = Task(None, ("\n", "Question:"), lambda it: f"{it.question} =",
             lambda it: f"The result is {it.answer}.", extract_result)


def task_for(data: dict) -> Task:
    return ARITH if data.get("source") == "chain_sum" else GSM


def completion_prompt(question: str, shots: list[evdata.GSMItem], task: Task = GSM) -> str:
    blocks = [task.instruction] if task.instruction else []
    blocks += [f"Question: {task.question(s)}\nAnswer: {task.solution(s)}" for s in shots]
    blocks.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(blocks)


def chat_messages(question: str, shots: list[evdata.GSMItem], task: Task = GSM) -> list[dict]:
    msgs = [{"role": "system", "content": task.instruction}] if task.instruction else []
    for s in shots:
        msgs += [{"role": "user", "content": f"Question: {task.question(s)}"},
                 {"role": "assistant", "content": task.solution(s)}]
    msgs.append({"role": "user", "content": f"Question: {question}"})
    return msgs


def apply_chat_template(tokenizer: Any, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # templates without a system role (e.g. Gemma) raise
        if messages[0]["role"] != "system":
            raise
        logger.warning("chat template refused a system message (%s); folding it into the first "
                       "user message", e)
        first = {"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
        return tokenizer.apply_chat_template([first] + messages[2:], tokenize=False,
                                             add_generation_prompt=True)


def build_prompts(items: list[evdata.GSMItem], shots: list[evdata.GSMItem], fmt: str,
                  tokenizer: Any = None, task: Task = GSM) -> list[str]:
    if fmt == "completion":
        return [completion_prompt(task.question(it), shots, task) for it in items]
    if fmt == "chat":
        if tokenizer is None:
            raise ValueError("prompt_format 'chat' needs the model's tokenizer")
        return [apply_chat_template(tokenizer, chat_messages(task.question(it), shots, task))
                for it in items]
    raise ValueError(f"unknown prompt format {fmt!r}; expected 'completion' or 'chat'")


# ----------------------------------------------------------------------------- tolerances

def sigma_max_drop(n: int, sigmas: float) -> float:
    """max_drop for `sigmas` standard deviations of an accuracy difference on n problems.

    A preset's accuracy a and auto's accuracy r on the same n problems are means of n 0/1
    outcomes, with per-problem success probabilities averaging p and q. Var(r − a) =
    (Var(r_i) + Var(a_i) − 2 Cov(r_i, a_i)) / n. The covariance is not negative: the preset runs
    the same model and differs only by cache error, so it tends to be right where auto is right
    (were the answers independent, Cov = 0). Each 0/1 variance is at most 1/4, so Var(r − a) <=
    1/(2n), whatever the accuracies and however strongly the answers agree. A preset exactly as
    accurate as auto therefore drops by more than sigmas·sqrt(1/(2n)) with probability at most
    Φ(−sigmas) (normal approximation: 0.13 % at 3), and that is the tolerance. It only widens
    with fewer problems — n = 150: 0.173, n = 50: 0.300 at 3 sigmas — so a small --limit
    still gates, but only against large drops (a broken cache, not a subtle one).
    """
    if n < 1:
        raise ValueError(f"need at least one problem, got {n}")
    return sigmas * math.sqrt(1.0 / (2 * n))


def sigma_tolerance(n: int, sigmas: float) -> float:
    """threshold tolerance for `sigmas` standard deviations of one accuracy on n problems: the
    variance of a mean of n 0/1 outcomes is at most 1/(4n) (same argument as
    :func:`sigma_max_drop`, one accuracy instead of a difference of two)."""
    if n < 1:
        raise ValueError(f"need at least one problem, got {n}")
    return sigmas * math.sqrt(1.0 / (4 * n))


def chance_accuracy(items: list[evdata.GSMItem]) -> float:
    """The accuracy of the best constant guess: the share of the commonest answer."""
    if not items:
        return 0.0
    return max(Counter(it.answer for it in items).values()) / len(items)


# ----------------------------------------------------------------------------- configs

class ConfigError(ValueError):
    pass


@dataclass
class GSMConfig:
    name: str
    model: str
    kv_cache_dtype: str
    num_questions: int
    num_shots: int
    max_tokens: int
    data: dict                       # {"source": "gsm_symbolic", "seed": S}, {"source": "jsonl", "path": P}
                                     # or {"source": "chain_sum", "seed": S, "terms": T, "digits": D}
    pass_rule: dict                  # threshold (+ tolerance or tolerance_sigmas) and/or max_drop
                                     # or max_drop_sigmas
    load_format: str | None = None
    engine_args: dict = field(default_factory=dict)
    shot_seed: int = 7
    prompt_format: str = "completion"
    description: str = ""


_REQUIRED = ("model", "kv_cache_dtype", "num_questions", "num_shots", "max_tokens", "data", "pass")
_DATA_KEYS = {"gsm_symbolic": {"source", "seed"}, "jsonl": {"source", "path"},
              "chain_sum": {"source", "seed", "terms", "digits"}}
_RULE_KEYS = ("threshold", "tolerance", "tolerance_sigmas", "max_drop", "max_drop_sigmas")
_OPTIONAL = ("name", "load_format", "engine_args", "shot_seed", "prompt_format", "description")


def configs_dir() -> Path:
    return Path(str(resources.files("tqattn") / "configs" / "evals"))


def list_configs() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


def expand_configs(names: list[str]) -> list[str]:
    """Config arguments with shell-style patterns ("SmolLM2-135M-arith-*") replaced by the
    shipped configs they match (in order); anything else is kept as given."""
    out = []
    for name in names:
        if any(c in name for c in "*?["):
            hits = [c for c in list_configs() if fnmatch.fnmatch(c.lower(), name.lower())]
            if not hits:
                raise ConfigError(f"no shipped config matches {name!r}; shipped: "
                                  f"{', '.join(list_configs())}")
            out += hits
        else:
            out.append(name)
    return out


def config_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    stem = p.name.removesuffix(".yaml").lower()
    for name in list_configs():
        if name.lower() == stem:
            return configs_dir() / f"{name}.yaml"
    raise ConfigError(f"no eval config file {str(name_or_path)!r} and no shipped config of that "
                      f"name; shipped: {', '.join(list_configs())}")


def _check_int(where: str, key: str, value: Any, lo: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{where}: {key} must be an integer >= {lo}, got {value!r}")
    return value


def _check_sigmas(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 10:
        raise ConfigError(f"{where}: {key} must be a number of standard deviations in (0, 10], "
                          f"got {value!r}")
    return float(value)


def _check_frac(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{where}: {key} must be a number in [0, 1], got {value!r}")
    return float(value)


def parse_config(raw: Any, where: str = "config") -> GSMConfig:
    from tqattn.quant.presets import PRESETS

    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level, got {type(raw).__name__}")
    unknown = set(raw) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; allowed: "
                          f"{sorted(_REQUIRED + _OPTIONAL)}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{where}: missing required keys {missing}")
    if not isinstance(raw["model"], str) or not raw["model"]:
        raise ConfigError(f"{where}: model must be a non-empty string")
    kv = raw["kv_cache_dtype"]
    if kv != "auto" and kv not in PRESETS:
        raise ConfigError(f"{where}: unknown kv_cache_dtype {kv!r}; expected 'auto' or one of "
                          f"{', '.join(PRESETS)}")
    engine_args = raw.get("engine_args") or {}
    if not isinstance(engine_args, dict):
        raise ConfigError(f"{where}: engine_args must be a mapping, got {engine_args!r}")
    clash = {"model", "kv_cache_dtype", "load_format"} & set(engine_args)
    if clash:
        raise ConfigError(f"{where}: engine_args must not set {sorted(clash)} (top-level keys)")

    d = raw["data"]
    if not isinstance(d, dict) or d.get("source") not in _DATA_KEYS:
        raise ConfigError(f"{where}: data must be {{source: gsm_symbolic, seed: N}}, "
                          f"{{source: jsonl, path: FILE}} or {{source: chain_sum, seed: N, terms: T, "
                          f"digits: D}}, got {d!r}")
    allowed = _DATA_KEYS[d["source"]]
    if set(d) - allowed:
        raise ConfigError(f"{where}: data keys {sorted(set(d) - allowed)} do not apply to "
                          f"source {d['source']}")
    shot_seed = _check_int(where, "shot_seed", raw.get("shot_seed", 7), 0)
    if d["source"] in ("gsm_symbolic", "chain_sum"):
        seed = _check_int(where, "data.seed", d.get("seed"), 0)
        if seed == shot_seed:
            raise ConfigError(f"{where}: data.seed and shot_seed are both {seed}; exemplars must "
                              "come from a different seed than the questions")
    if d["source"] == "chain_sum":
        d = {"source": "chain_sum", "seed": d["seed"],
             "terms": _check_int(where, "data.terms", d.get("terms", 2), 2),
             "digits": _check_int(where, "data.digits", d.get("digits", 1), 1)}
    elif d.get("path") is not None and not isinstance(d["path"], str):
        raise ConfigError(f"{where}: data.path must be a string path, got {d['path']!r}")

    rule = raw["pass"]
    if not isinstance(rule, dict) or not rule or set(rule) - set(_RULE_KEYS):
        raise ConfigError(f"{where}: pass must be a mapping with threshold (and tolerance or "
                          f"tolerance_sigmas) and/or max_drop or max_drop_sigmas, got {rule!r}")
    if ("tolerance" in rule or "tolerance_sigmas" in rule) and "threshold" not in rule:
        raise ConfigError(f"{where}: pass.tolerance needs pass.threshold")
    for a, b in (("tolerance", "tolerance_sigmas"), ("max_drop", "max_drop_sigmas")):
        if a in rule and b in rule:
            raise ConfigError(f"{where}: give pass.{a} or pass.{b}, not both")
    rule = {k: (_check_sigmas if k.endswith("_sigmas") else _check_frac)(where, f"pass.{k}", v)
            for k, v in rule.items()}
    fmt = raw.get("prompt_format", "completion")
    if fmt not in ("completion", "chat"):
        raise ConfigError(f"{where}: prompt_format must be 'completion' or 'chat', got {fmt!r}")
    lf = raw.get("load_format")
    if lf is not None and not isinstance(lf, str):
        raise ConfigError(f"{where}: load_format must be a string, got {lf!r}")
    return GSMConfig(
        name=str(raw.get("name") or Path(where).stem),
        model=raw["model"], kv_cache_dtype=kv,
        num_questions=_check_int(where, "num_questions", raw["num_questions"], 1),
        num_shots=_check_int(where, "num_shots", raw["num_shots"], 0),
        max_tokens=_check_int(where, "max_tokens", raw["max_tokens"], 1),
        data=dict(d), pass_rule=rule, load_format=lf, engine_args=dict(engine_args),
        shot_seed=shot_seed, prompt_format=fmt, description=str(raw.get("description", "")),
    )


def load_config(name_or_path: str | Path) -> GSMConfig:
    import yaml

    path = config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(raw, str(path))


def override(cfg: GSMConfig, *, model: str | None = None, data: str | None = None,
             load_format: str | None = None) -> GSMConfig:
    """CLI overrides. `data` is a JSONL path, or "gsm_symbolic[:SEED]" / "chain_sum[:SEED]"
    (a chain_sum config keeps its terms and digits)."""
    if model:
        cfg = replace(cfg, model=model)
    if load_format:
        cfg = replace(cfg, load_format=load_format)
    if data:
        source, _, seed = data.partition(":")
        if source in ("gsm_symbolic", "chain_sum"):
            try:
                s = int(seed) if seed else cfg.data.get("seed", 1234)
            except ValueError:
                raise ConfigError(f"--data {data!r}: the seed after ':' must be an integer") from None
            if s == cfg.shot_seed:
                raise ConfigError(f"data seed {s} equals shot_seed; pick another")
            new = {"source": source, "seed": s}
            if source == "chain_sum":
                new.update(terms=cfg.data.get("terms", 2), digits=cfg.data.get("digits", 1))
            cfg = replace(cfg, data=new)
        else:
            cfg = replace(cfg, data={"source": "jsonl", "path": data})
    return cfg


# ----------------------------------------------------------------------------- evaluation

def load_items(cfg: GSMConfig, n: int) -> list[evdata.GSMItem]:
    d = cfg.data
    if d["source"] == "gsm_symbolic":
        return evdata.gsm_symbolic_items(n, d["seed"])
    if d["source"] == "chain_sum":
        return evdata.chain_sum_items(n, d["seed"], d["terms"], d["digits"])
    path = d.get("path")
    if not path:
        raise ConfigError(f"config {cfg.name} reads the GSM8K test set from a JSONL file: pass "
                          "--data PATH/test.jsonl (or --data gsm_symbolic for generated problems)")
    items = evdata.load_gsm8k_jsonl(path, n)
    if not items:
        raise ConfigError(f"{path} holds no GSM8K questions")
    if len(items) < n:
        logger.warning("%s has only %d questions (asked for %d)", path, len(items), n)
    return items


def load_shots(cfg: GSMConfig, items: list[evdata.GSMItem]) -> list[evdata.GSMItem]:
    d = cfg.data
    if d["source"] == "chain_sum":
        return evdata.chain_sum_items(cfg.num_shots, cfg.shot_seed, d["terms"], d["digits"],
                                      exclude=items)
    return evdata.fewshot_items(cfg.num_shots, cfg.shot_seed, exclude=items)


def _check_model(cfg: GSMConfig) -> None:
    m = cfg.model
    if cfg.load_format == "dummy" or m == "default" or m.startswith("internal:"):
        return
    if not Path(m).expanduser().exists():
        raise FileNotFoundError(
            f"model {m!r} of config {cfg.name} is not a local file or directory; the engine loads "
            "local model directories (safetensors), GGUF files and 'default' only. Download the "
            "weights and pass --model /path/to/model")


def _evaluate(llm: Any, prompts: list[str], items: list[evdata.GSMItem], max_tokens: int,
              task: Task = GSM) -> dict:
    t0 = time.perf_counter()
    params = scoring.greedy_params(max_tokens, list(task.stop))
    # The first prompt alone first: it puts the exemplars every prompt shares into the prefix
    # cache (where the engine keeps one), so the others prefill only their question — and read
    # the exemplars from the cache, compressed, as a served few-shot prompt would.
    texts = [t for part in (prompts[:1], prompts[1:]) if part
             for t in scoring.generate_texts(llm, part, params)]
    samples = []
    for it, text in zip(items, texts):
        pred = task.extract(text)
        samples.append({"question": it.question, "gold": it.answer, "pred": pred,
                        "correct": is_correct(pred, it.answer), "output": text})
    correct = sum(s["correct"] for s in samples)
    return {"accuracy": correct / len(samples), "correct": correct,
            "no_answer": sum(s["pred"] is None for s in samples),
            "elapsed_s": round(time.perf_counter() - t0, 2), "samples": samples}


def _reference_key(cfg: GSMConfig, n: int) -> str:
    """What the auto run of a config depends on: configs that agree on it share one auto run."""
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("name", "kv_cache_dtype", "pass_rule",
                                                               "description", "num_questions")}
    return json.dumps({**keep, "n": n}, sort_keys=True, default=str)


def _checks(rule: dict, acc: float, ref: float | None, n: int) -> list[dict]:
    checks = []
    if "threshold" in rule:
        tol = (sigma_tolerance(n, rule["tolerance_sigmas"]) if "tolerance_sigmas" in rule
               else rule.get("tolerance", 0.0))
        bound = rule["threshold"] - tol
        checks.append({"rule": "threshold - tolerance", "tolerance": round(tol, 6),
                       "bound": round(bound, 6), "passed": acc >= bound - 1e-9})
    if "max_drop" in rule or "max_drop_sigmas" in rule:
        drop = (sigma_max_drop(n, rule["max_drop_sigmas"]) if "max_drop_sigmas" in rule
                else rule["max_drop"])
        bound = ref - drop
        checks.append({"rule": "auto accuracy - max_drop", "auto_accuracy": ref,
                       "max_drop": round(drop, 6), "bound": round(bound, 6),
                       "passed": acc >= bound - 1e-9})
    for c in checks:  # a bound at or below 0 passes any accuracy: too few problems to test
        c["vacuous"] = c["bound"] <= 0
    return checks


def run_gsm8k(cfg: GSMConfig, *, limit: int | None = None,
              factory: scoring.LLMFactory | None = None,
              reference_runs: dict | None = None) -> dict:
    """Run one config; with pass.max_drop(_sigmas), the same config with kv_cache_dtype "auto"
    runs first on the same problems.

    `factory(kv_cache_dtype) -> llm` replaces the engine (tests). `reference_runs`: a dict
    shared between calls, so that configs differing only in their preset and pass rule run
    auto once. Returns a JSON-able dict with accuracy, the pass checks and every sample.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    n = min(cfg.num_questions, limit) if limit else cfg.num_questions
    if factory is None:
        _check_model(cfg)
        factory = scoring.llm_factory(cfg.model, load_format=cfg.load_format,
                                      engine_args=cfg.engine_args)
    task = task_for(cfg.data)
    items = load_items(cfg, n)
    shots = load_shots(cfg, items)

    def evaluate(llm):
        tok = scoring.get_tokenizer(llm) if cfg.prompt_format == "chat" else None
        return _evaluate(llm, build_prompts(items, shots, cfg.prompt_format, tok, task), items,
                         cfg.max_tokens, task)

    rule = cfg.pass_rule
    relative = "max_drop" in rule or "max_drop_sigmas" in rule
    refs = reference_runs if reference_runs is not None else {}
    key = _reference_key(cfg, n)
    runs: dict[str, dict] = {}
    ran = []                          # the runs made by this call (a shared auto run is not)
    for kv in dict.fromkeys((["auto"] if relative else []) + [cfg.kv_cache_dtype]):
        if kv == "auto" and key in refs:
            runs[kv] = refs[key]
            continue
        runs[kv] = scoring.with_llm(factory, kv, evaluate)
        ran.append(kv)
        if kv == "auto":
            refs[key] = runs[kv]
        logger.info("%s [%s]: accuracy %.4f (%d/%d)", cfg.name, kv, runs[kv]["accuracy"],
                    runs[kv]["correct"], len(items))

    main = runs[cfg.kv_cache_dtype]
    acc = main["accuracy"]
    ref = runs["auto"]["accuracy"] if "auto" in runs else None
    checks = _checks(rule, acc, ref, len(items))
    for c in checks:
        if c["vacuous"]:
            logger.warning("%s: with %d problems the check %r cannot fail (bound %.3f <= 0): its "
                           "pass says nothing; run more problems", cfg.name, len(items), c["rule"], c["bound"])
    return {
        "config": cfg.name, "model": cfg.model, "kv_cache_dtype": cfg.kv_cache_dtype,
        "data": cfg.data, "num_questions": len(items), "limited": n < cfg.num_questions,
        "num_shots": cfg.num_shots, "prompt_format": cfg.prompt_format,
        "accuracy": acc, "correct": main["correct"], "no_answer": main["no_answer"],
        "chance": chance_accuracy(items), "auto_accuracy": ref,
        "checks": checks, "passed": all(c["passed"] for c in checks),
        "elapsed_s": round(sum(runs[kv]["elapsed_s"] for kv in ran), 2),
        "settings": asdict(cfg), "samples": main["samples"],
    }
