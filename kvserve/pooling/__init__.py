"""Pooling models: embeddings from a model's hidden states (vLLM's `--runner pooling`).

    config.py      the runner choice and the pooler settings (sentence-transformers config)
    pooler.py      the worker-side Pooler: LAST / MEAN / CLS / ALL over (chunked) prefills
    scheduling.py  the scheduler hook: a pooling request ends once its prompt is pooled

A pooling request is prefill only: it shares the scheduler (and chunked prefill) with
generation, writes KV only while its prompt is being computed, and frees it at once.
"""
