"""A token generator over an attnopt decode folder that needs numpy and onnxruntime only.

`Session` runs the graph by its contract (contract.py): zeros for every initial state, each present
fed back as the next call's past, attention_mask over every column so far, position_ids as
transformers' generate makes them. `Generator.generate` samples on top of it (greedy, temperature,
top-k, top-p), stops a row at the model's end-of-sequence token as transformers' generate() does
(unless told otherwise: `eos_token_id`), and returns numpy [batch, prompt + new].
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from attnopt.onnx.contract import CONTRACT_KEY, Contract, hf_positions

MODEL_FILE = "model.onnx"
MODEL_EOS = "model"  # eos_token_id's default: the exported model's own end-of-sequence token(s)


class Session:
    """One ONNX Runtime session of a decode graph, driven by its contract only."""

    def __init__(self, path, providers: Optional[Sequence[str]] = None, threads: Optional[int] = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = int(threads)
            options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), options, providers=list(providers or ["CPUExecutionProvider"]))
        meta = self.session.get_modelmeta().custom_metadata_map
        if CONTRACT_KEY not in meta:
            raise ValueError(f"{path} has no metadata {CONTRACT_KEY!r}: it is not an attnopt decode graph; export one "
                             "with attnopt.export_onnx(model, folder, decode=True)")
        self.contract = Contract.from_json(meta[CONTRACT_KEY])
        self._outputs = ["logits"] + [s["present"] for s in self.contract.states]
        self._pasts = [s["past"] for s in self.contract.states]

    def initial_state(self, batch: int) -> dict:
        return self.contract.initial_state(batch)

    def run(self, input_ids, attention_mask, position_ids, state: dict) -> tuple[np.ndarray, dict]:
        """One call: T new tokens after the state's columns; returns (logits [B, T, V], next state)."""
        feeds = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                 "attention_mask": np.ascontiguousarray(attention_mask, dtype=np.int64),
                 "position_ids": np.ascontiguousarray(position_ids, dtype=np.int64), **state}
        out = self.session.run(self._outputs, feeds)
        return out[0], dict(zip(self._pasts, out[1:]))

    def prefill(self, input_ids, attention_mask, chunk: Optional[int] = None) -> tuple[np.ndarray, dict]:
        """The prompt in one call, or in calls of `chunk` tokens; returns (last logits [B, V], state)."""
        ids, mask = np.asarray(input_ids, np.int64), np.asarray(attention_mask, np.int64)
        N = ids.shape[1]
        positions = hf_positions(mask)
        state = self.initial_state(ids.shape[0])
        step = N if not chunk else int(chunk)
        logits = None
        for a in range(0, N, step):
            b = min(N, a + step)
            logits, state = self.run(ids[:, a:b], mask[:, :b], positions[:, a:b], state)
        return logits[:, -1], state


def _as_ids(ids) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integer token ids [batch, length >= 1]; got shape {ids.shape}, "
                         f"dtype {ids.dtype}")
    return ids.astype(np.int64)


def _filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Probabilities after temperature, top-k and top-p (nucleus), in transformers' order."""
    x = logits.astype(np.float64) / temperature
    if top_k and top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(p, axis=-1)  # ascending, as transformers' TopPLogitsWarper
        sorted_p = np.take_along_axis(p, order, -1)
        drop_sorted = np.cumsum(sorted_p, -1) <= (1.0 - top_p)
        drop_sorted[:, -1] = False  # always keep the most likely token
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(-1, keepdims=True)
    return p


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        self.total, self.enabled, self.done = total, enabled, 0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="generate", unit="tok", leave=False)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            width = 30
            filled = width * self.done // max(1, self.total)
            sys.stderr.write(f"\rgenerate [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


class Generator:
    """Generate from a decode folder (or its model.onnx) with ONNX Runtime; numpy in, numpy out.
    `providers`: ONNX Runtime execution providers (default CPU); `threads`: its intra-op threads
    (default ONNX Runtime's)."""

    def __init__(self, out_dir, providers: Optional[Sequence[str]] = None, threads: Optional[int] = None):
        path = Path(out_dir)
        model = path / MODEL_FILE if path.is_dir() else path
        if not model.is_file():
            raise FileNotFoundError(f"no {MODEL_FILE} in {str(out_dir)!r}; write one with "
                                    f"attnopt.export_onnx(model, {str(out_dir)!r}, decode=True)")
        self.folder = model.parent
        self.session = Session(model, providers, threads)

    @property
    def contract(self) -> Contract:
        return self.session.contract

    def generate(self, input_ids, attention_mask=None, *, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 eos_token_id: Union[str, None, int, Iterable[int]] = MODEL_EOS, pad_token_id: Optional[int] = None,
                 prefill_chunk: Optional[int] = None, progress: bool = False) -> np.ndarray:
        """Token ids [batch, prompt + new]. `attention_mask` (1 = real token; left padding allowed)
        defaults to all ones.

        `eos_token_id`: where a row stops. "model" (the default): at the exported model's own
        end-of-sequence token(s), from its generation config, as transformers' generate() stops; an
        id or a list of ids: at those; None: never early, every row gets `max_new_tokens` (what a
        model with random weights needs, whose "eos" is any token). A row that stops gets
        `pad_token_id` (default the model's pad, else its eos) after it; generation ends when every
        row has stopped. `prefill_chunk`: feed the prompt in chunks of that many tokens.
        `progress`: a progress bar on stderr."""
        ids = _as_ids(input_ids)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask has shape {mask.shape}; it must match input_ids {ids.shape}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if do_sample and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
            raise ValueError(f"sampling needs temperature > 0, 0 < top_p <= 1 and top_k >= 0; got temperature="
                             f"{temperature}, top_p={top_p}, top_k={top_k}")
        eos = self._eos(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else self.contract.token_id("pad_token_id")
        pad = pad if pad is not None else (min(eos) if eos else 0)
        if max_new_tokens == 0:
            return ids
        rng = np.random.default_rng(seed)
        logits, state = self.session.prefill(ids, mask, prefill_chunk)
        out, finished = [ids], np.zeros(ids.shape[0], dtype=bool)
        bar = _Progress(max_new_tokens, progress)
        try:
            for step in range(max_new_tokens):
                chosen = self._choose(logits, do_sample, temperature, top_k, top_p, rng)
                chosen = np.where(finished, pad, chosen)
                out.append(chosen[:, None])
                finished |= np.isin(chosen, list(eos))
                bar.update()
                if finished.all() or step == max_new_tokens - 1:
                    break
                mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], axis=1)
                logits, state = self.session.run(chosen[:, None], mask, mask.sum(1, keepdims=True) - 1, state)
                logits = logits[:, -1]
        finally:
            bar.close()
        return np.concatenate(out, axis=1)

    def _eos(self, eos_token_id) -> set:
        if isinstance(eos_token_id, str):
            if eos_token_id != MODEL_EOS:
                raise ValueError(f"eos_token_id must be {MODEL_EOS!r} (the model's own), None (never stop early), an "
                                 f"id or a list of ids; got {eos_token_id!r}")
            eos_token_id = self.contract.data.get("eos_token_id")
        if eos_token_id is None:
            return set()
        return {int(eos_token_id)} if isinstance(eos_token_id, (int, np.integer)) else {int(e) for e in eos_token_id}

    @staticmethod
    def _choose(logits: np.ndarray, do_sample: bool, temperature: float, top_k: int, top_p: float, rng) -> np.ndarray:
        if not do_sample:
            return logits.argmax(-1).astype(np.int64)
        p = _filtered(logits, temperature, top_k, top_p)
        u = rng.random((p.shape[0], 1))
        return np.minimum((np.cumsum(p, -1) < u).sum(-1), p.shape[-1] - 1).astype(np.int64)
