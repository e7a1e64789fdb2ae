"""GSM8K-style few-shot chain-of-thought accuracy through the engine, gated by YAML configs.

A config (tqattn/configs/evals/*.yaml, or any path) names the model, the KV-cache preset, engine
arguments, the data and the pass rule; see `GSMConfig` and the shipped files for the schema.
Prompts: exemplars are worked gsm_symbolic solutions ("Question: ...\\nAnswer: <steps>\\n#### N")
drawn with a seed different from the questions'; decoding is greedy and stops at the next
"Question:". The pass rule is accuracy >= threshold - tolerance and/or accuracy >= (accuracy of
the same config with kv_cache_dtype "auto", run first) - max_drop.
"""

from __future__ import annotations

import logging
import re
import time
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


def format_solution(item: evdata.GSMItem) -> str:
    return f"{item.cot}\n#### {item.answer}"


def completion_prompt(question: str, shots: list[evdata.GSMItem]) -> str:
    blocks = [INSTRUCTION]
    blocks += [f"Question: {s.question}\nAnswer: {format_solution(s)}" for s in shots]
    blocks.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(blocks)


def chat_messages(question: str, shots: list[evdata.GSMItem]) -> list[dict]:
    msgs = [{"role": "system", "content": INSTRUCTION}]
    for s in shots:
        msgs += [{"role": "user", "content": f"Question: {s.question}"},
                 {"role": "assistant", "content": format_solution(s)}]
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
                  tokenizer: Any = None) -> list[str]:
    if fmt == "completion":
        return [completion_prompt(it.question, shots) for it in items]
    if fmt == "chat":
        if tokenizer is None:
            raise ValueError("prompt_format 'chat' needs the model's tokenizer")
        return [apply_chat_template(tokenizer, chat_messages(it.question, shots)) for it in items]
    raise ValueError(f"unknown prompt format {fmt!r}; expected 'completion' or 'chat'")


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
    data: dict                       # {"source": "gsm_symbolic", "seed": S} or {"source": "jsonl", "path": P}
    pass_rule: dict                  # threshold, tolerance, max_drop (each optional, >= 1 given)
    load_format: str | None = None
    engine_args: dict = field(default_factory=dict)
    shot_seed: int = 7
    prompt_format: str = "completion"
    description: str = ""


_REQUIRED = ("model", "kv_cache_dtype", "num_questions", "num_shots", "max_tokens", "data", "pass")
_OPTIONAL = ("name", "load_format", "engine_args", "shot_seed", "prompt_format", "description")


def configs_dir() -> Path:
    return Path(str(resources.files("tqattn") / "configs" / "evals"))


def list_configs() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


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
    if not isinstance(d, dict) or d.get("source") not in ("gsm_symbolic", "jsonl"):
        raise ConfigError(f"{where}: data must be {{source: gsm_symbolic, seed: N}} or "
                          f"{{source: jsonl, path: FILE}}, got {d!r}")
    allowed = {"gsm_symbolic": {"source", "seed"}, "jsonl": {"source", "path"}}[d["source"]]
    if set(d) - allowed:
        raise ConfigError(f"{where}: data keys {sorted(set(d) - allowed)} do not apply to "
                          f"source {d['source']}")
    shot_seed = _check_int(where, "shot_seed", raw.get("shot_seed", 7), 0)
    if d["source"] == "gsm_symbolic":
        seed = _check_int(where, "data.seed", d.get("seed"), 0)
        if seed == shot_seed:
            raise ConfigError(f"{where}: data.seed and shot_seed are both {seed}; exemplars must "
                              "come from a different seed than the questions")
    elif d.get("path") is not None and not isinstance(d["path"], str):
        raise ConfigError(f"{where}: data.path must be a string path, got {d['path']!r}")

    rule = raw["pass"]
    if not isinstance(rule, dict) or not rule or set(rule) - {"threshold", "tolerance", "max_drop"}:
        raise ConfigError(f"{where}: pass must be a mapping with threshold (and tolerance) and/or "
                          f"max_drop, got {rule!r}")
    if "tolerance" in rule and "threshold" not in rule:
        raise ConfigError(f"{where}: pass.tolerance needs pass.threshold")
    rule = {k: _check_frac(where, f"pass.{k}", v) for k, v in rule.items()}
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
    """CLI overrides. `data` is a JSONL path, or "gsm_symbolic" / "gsm_symbolic:SEED"."""
    if model:
        cfg = replace(cfg, model=model)
    if load_format:
        cfg = replace(cfg, load_format=load_format)
    if data:
        if data.startswith("gsm_symbolic"):
            _, _, seed = data.partition(":")
            s = int(seed) if seed else cfg.data.get("seed", 1234)
            if s == cfg.shot_seed:
                raise ConfigError(f"data seed {s} equals shot_seed; pick another")
            cfg = replace(cfg, data={"source": "gsm_symbolic", "seed": s})
        else:
            cfg = replace(cfg, data={"source": "jsonl", "path": data})
    return cfg


# ----------------------------------------------------------------------------- evaluation

def load_items(cfg: GSMConfig, n: int) -> list[evdata.GSMItem]:
    if cfg.data["source"] == "gsm_symbolic":
        return evdata.gsm_symbolic_items(n, cfg.data["seed"])
    path = cfg.data.get("path")
    if not path:
        raise ConfigError(f"config {cfg.name} reads the GSM8K test set from a JSONL file: pass "
                          "--data PATH/test.jsonl (or --data gsm_symbolic for generated problems)")
    items = evdata.load_gsm8k_jsonl(path, n)
    if len(items) < n:
        logger.warning("%s has only %d questions (asked for %d)", path, len(items), n)
    return items


def _check_model(cfg: GSMConfig) -> None:
    m = cfg.model
    if cfg.load_format == "dummy" or m == "default" or m.startswith("internal:"):
        return
    if not Path(m).expanduser().exists():
        raise FileNotFoundError(
            f"model {m!r} of config {cfg.name} is not a local file or directory; the engine loads "
            "local model directories (safetensors), GGUF files and 'default' only. Download the "
            "weights and pass --model /path/to/model")


def _evaluate(llm: Any, prompts: list[str], items: list[evdata.GSMItem], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    texts = scoring.generate_texts(llm, prompts, scoring.greedy_params(max_tokens, STOP))
    samples = []
    for it, text in zip(items, texts):
        pred = extract_answer(text)
        samples.append({"question": it.question, "gold": it.answer, "pred": pred,
                        "correct": is_correct(pred, it.answer), "output": text})
    correct = sum(s["correct"] for s in samples)
    return {"accuracy": correct / len(samples), "correct": correct,
            "no_answer": sum(s["pred"] is None for s in samples),
            "elapsed_s": round(time.perf_counter() - t0, 2), "samples": samples}


def run_gsm8k(cfg: GSMConfig, *, limit: int | None = None,
              factory: scoring.LLMFactory | None = None) -> dict:
    """Run one config; with pass.max_drop, the same config with kv_cache_dtype "auto" runs first.

    `factory(kv_cache_dtype) -> llm` replaces the engine (tests). Returns a JSON-able dict with
    accuracy, the pass checks and every sample.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    n = min(cfg.num_questions, limit) if limit else cfg.num_questions
    if factory is None:
        _check_model(cfg)
        factory = scoring.llm_factory(cfg.model, load_format=cfg.load_format,
                                      engine_args=cfg.engine_args)
    items = load_items(cfg, n)
    shots = evdata.fewshot_items(cfg.num_shots, cfg.shot_seed, exclude=items)

    runs: dict[str, dict] = {}
    order = [cfg.kv_cache_dtype]
    if "max_drop" in cfg.pass_rule and cfg.kv_cache_dtype != "auto":
        order.insert(0, "auto")
    def evaluate(llm):
        tok = scoring.get_tokenizer(llm) if cfg.prompt_format == "chat" else None
        return _evaluate(llm, build_prompts(items, shots, cfg.prompt_format, tok), items,
                         cfg.max_tokens)

    for kv in order:
        runs[kv] = scoring.with_llm(factory, kv, evaluate)
        logger.info("%s [%s]: accuracy %.4f (%d/%d)", cfg.name, kv, runs[kv]["accuracy"],
                    runs[kv]["correct"], len(items))

    main = runs[cfg.kv_cache_dtype]
    acc = main["accuracy"]
    checks = []
    rule = cfg.pass_rule
    if "threshold" in rule:
        bound = rule["threshold"] - rule.get("tolerance", 0.0)
        checks.append({"rule": "threshold - tolerance", "bound": round(bound, 6),
                       "passed": acc >= bound - 1e-9})
    if "max_drop" in rule:
        ref = runs["auto"]["accuracy"]
        bound = ref - rule["max_drop"]
        checks.append({"rule": "auto accuracy - max_drop", "auto_accuracy": ref,
                       "bound": round(bound, 6), "passed": acc >= bound - 1e-9})
    return {
        "config": cfg.name, "model": cfg.model, "kv_cache_dtype": cfg.kv_cache_dtype,
        "data": cfg.data, "num_questions": len(items), "limited": n < cfg.num_questions,
        "num_shots": cfg.num_shots, "prompt_format": cfg.prompt_format,
        "accuracy": acc, "correct": main["correct"], "no_answer": main["no_answer"],
        "auto_accuracy": runs["auto"]["accuracy"] if "auto" in runs else None,
        "checks": checks, "passed": all(c["passed"] for c in checks),
        "elapsed_s": round(sum(r["elapsed_s"] for r in runs.values()), 2),
        "settings": asdict(cfg), "samples": main["samples"],
    }
