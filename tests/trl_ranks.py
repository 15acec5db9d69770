"""One rank of a TRL run on several processes (started by the tests with torchrun): the tiny model in argv[1],
results as JSON in argv[2].RANK.json. With argv[3], a JSON list of runs ({"name", "config": GRPOConfig overrides,
"monitor_settings"}), each trained in turn with a monitor the trainer makes, results in argv[2].NAME.RANK.json.
Not collected by pytest (no test_ prefix)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import GRPOConfig

from grpo_exporter import GRPOMonitor
from grpo_exporter.integrations.trl import MonitoredGRPOTrainer


def accuracy(completions: list[str], **_: object) -> list[float]:
    return [1.0 if "three" in c.split() else 0.0 for c in completions]


PROMPTS = [f"add {a} plus {b}" for a in ("one", "two", "four") for b in ("two", "five", "six")]


def tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"), pad_token="<pad>",
                                   eos_token="<eos>", unk_token="<unk>")


def run(model_dir: str, out: str, rank: int, spec: dict[str, Any]) -> None:
    """One of argv[3]'s runs: the trainer makes its monitor (strict, no port) from TRL's config."""
    name = spec["name"]
    args = GRPOConfig(**{"output_dir": str(Path(out).parent / f"o-{name}-{rank}"), "max_completion_length": 6,
                         "max_steps": 2, "report_to": [], "use_cpu": True, "save_strategy": "no", "seed": 0,
                         "run_name": name, **spec["config"]})
    trainer = MonitoredGRPOTrainer(
        model=model_dir, reward_funcs=[accuracy], args=args, processing_class=tokenizer(model_dir),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), verifier="accuracy",
        monitor_settings={"port": None, "strict": True, "close_linger_s": 0, **spec.get("monitor_settings", {})})
    trainer.train()
    result = {"published": dict(trainer.monitor.metrics()), "world": trainer.accelerator.num_processes,
              "steps": trainer.state.global_step}
    Path(f"{out}.{name}.{rank}.json").write_text(json.dumps(result))


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if len(sys.argv) > 3:
        for spec in json.loads(sys.argv[3]):
            run(model_dir, out, rank, spec)
        return
    tok = tokenizer(model_dir)
    args = GRPOConfig(output_dir=str(Path(out).parent / f"o{rank}"), per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=6, max_steps=2, report_to=[], use_cpu=True,
                      save_strategy="no", logging_steps=1, seed=0)
    prompts = PROMPTS
    monitor = GRPOMonitor(run="trl-ranks", group_size=4, port=0, strict=True, close_linger_s=0)
    trainer = MonitoredGRPOTrainer(model=model_dir, reward_funcs=[accuracy], args=args, processing_class=tok,
                                   train_dataset=Dataset.from_dict({"prompt": prompts}), monitor=monitor,
                                   verifier="accuracy")
    trainer.train()
    result = {
        "url": monitor.url,
        "published": dict(monitor.metrics()),
        "logged_reward": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "world": trainer.accelerator.num_processes,
    }
    if monitor.url:
        from urllib.request import urlopen

        result["scrape"] = urlopen(monitor.url, timeout=10).read().decode()
    monitor.close()
    Path(f"{out}.{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
