"""The engine on the oldest torch mllmd supports (2.4, Jetson Orin's) against transformers on a newer one.

transformers 5 serves configs and tokenizers only below torch 2.6, so under torch 2.4 the test suite
can neither build its random checkpoints nor run transformers' models as the reference. This script
splits the parity check across two environments:

    # where transformers' model classes work (CI's .venv: torch 2.13): build the checkpoints and
    # record transformers' greedy tokens (fp32, CPU)
    .venv/bin/python scripts/torch_floor_check.py reference --out DIR
    # under torch 2.4 (configs and tokenizers only): mllmd's greedy tokens must be the same
    .ci-torch24/bin/python scripts/torch_floor_check.py check --dir DIR

Models: tiny random Qwen3 (dense), Qwen3-VL (4 vision blocks, deepstack) and Qwen3.5 (3 Gated DeltaNet
layers + 1 full attention, decays re-drawn for long memory), built from the vendored real configs.
Cases: text prompts batched together, prefilled in chunks of 41 tokens (a recurrent state carried
across chunks), and for the two vision models an image prompt through the chat path.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path
from typing import Any

NEW = 32
CHUNK = 41
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "请用一句话介绍一下你自己。",
    "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, "
    "Brownian motion, special relativity and the equivalence of mass and energy. Summarise them in a list "
    "of four short items, one per paper, each with the year and the journal it appeared in.",
]
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": {"source": "Qwen3-0.6B", "seed": 1, "image": False},
    "qwen3_vl": {"source": "Qwen3-VL-2B-Instruct", "seed": 3, "image": True,
                 "extra_overrides": {"vision_config": {"depth": 4, "deepstack_visual_indexes": [1, 2]}}},
    "qwen3_5": {"source": "Qwen3.5-0.8B", "seed": 5, "image": True, "num_hidden_layers": 4, "head_dim": 32},
}


def _image_part(seed: int) -> dict[str, Any]:
    """A small smooth picture as a data URL (random tower weights make the output depend on it)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:48, 0:64]
    chans = [np.sin(x / (7 + 5 * rng.random()) + rng.random() * 6) + np.cos(y / (9 + 4 * rng.random())) for _ in range(3)]
    img = Image.fromarray(((np.stack(chans, -1) + 2) * 63).clip(0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def _messages(seed: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in"}, _image_part(seed),
                                         {"type": "text", "text": "this picture?"}]}]


def _llm(path: Path) -> Any:
    from mllmd import LLM

    return LLM(str(path), device="cpu", dtype="float32", chunked_prefill_size=CHUNK)


def _greedy() -> Any:
    from mllmd import SamplingParams

    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


CHAT_KWARGS = {"enable_thinking": False}


def _build(name: str, spec: dict[str, Any], out: Path) -> Path:
    from mllmd.testing import checkpoints as ck

    kwargs = {k: v for k, v in spec.items() if k not in ("source", "image")}
    path = ck.build_tiny_checkpoint(out / name, spec["source"], **kwargs)
    if name == "qwen3_5":  # long memory: exp(A) in [0.001, 0.05] (with the default most heads forget at once)
        ck.redraw_decays(path, seed=11)
    return path


def reference(out: Path) -> int:
    import torch
    from transformers import (
        AutoImageProcessor,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # CI's log: one line a model
    out.mkdir(parents=True, exist_ok=True)
    expected: dict[str, Any] = {"torch": torch.__version__, "models": {}}
    for name, spec in MODELS.items():
        path = _build(name, spec, out)
        auto = AutoModelForImageTextToText if spec["image"] else AutoModelForCausalLM
        hf = auto.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        cases = []
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            cases.append({"ids": ids, "want": _hf_greedy(hf, ids)})
        if spec["image"]:  # the prompt ids mllmd's chat path builds, transformers' own pixel values
            llm = _llm(path)
            messages = _messages(spec["seed"])
            ids = llm.chat(messages, _greedy(), chat_template_kwargs=CHAT_KWARGS)[0].prompt_token_ids
            pix = AutoImageProcessor.from_pretrained(path)(images=[_decode(messages)], return_tensors="pt")
            pad = llm.engine.info.image_token_id
            want = _hf_greedy(hf, ids, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                              mm_token_type_ids=(torch.tensor([ids]) == pad).long())
            cases.append({"messages": messages, "prompt_ids": ids, "want": want})
        expected["models"][name] = {"path": path.name, "cases": cases}
        print(f"{name}: {len(cases)} cases recorded with transformers on torch {torch.__version__}", flush=True)
    (out / "expected.json").write_text(json.dumps(expected))
    return 0


def _decode(messages: list[dict[str, Any]]) -> Any:
    from PIL import Image

    url = next(p for p in messages[0]["content"] if p["type"] == "image_url")["image_url"]["url"]
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


def _hf_greedy(hf: Any, ids: list[int], **extra: Any) -> list[int]:
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                        do_sample=False, **extra)
    return y[0, len(ids):].tolist()


def check(root: Path) -> int:
    import torch

    expected = json.loads((root / "expected.json").read_text())
    failures = 0
    for name, model in expected["models"].items():
        llm = _llm(root / model["path"])
        text = [c for c in model["cases"] if "ids" in c]
        outs = llm.generate([c["ids"] for c in text], _greedy())  # one batch, prefilled in chunks
        results = [(f"prompt {i}", o.token_ids, c["want"]) for i, (o, c) in enumerate(zip(outs, text))]
        for c in model["cases"]:
            if "messages" in c:
                got = llm.chat(c["messages"], _greedy(), chat_template_kwargs=CHAT_KWARGS)[0]
                if got.prompt_token_ids != c["prompt_ids"]:
                    results.append(("image prompt ids", got.prompt_token_ids, c["prompt_ids"]))
                results.append(("image prompt", got.token_ids, c["want"]))
        for label, got_ids, want in results:
            ok = got_ids == want
            failures += not ok
            if not ok:
                print(f"  {name} {label}: MISMATCH\n    got  {got_ids}\n    want {want}")
        print(f"{name}: {sum(g == w for _, g, w in results)}/{len(results)} cases equal transformers "
              f"(torch {expected['torch']}) on torch {torch.__version__}", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/torch_floor_check.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("reference", help="build the checkpoints, record transformers' tokens").add_argument("--out", required=True)
    sub.add_parser("check", help="mllmd's tokens must equal the recorded ones").add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    return reference(Path(args.out)) if args.cmd == "reference" else check(Path(args.dir))


if __name__ == "__main__":
    sys.exit(main())
