"""Text: the model's tokenizer (loaded from a Hugging Face directory or a GGUF file, without transformers or
torch), chat templates, incremental detokenization, stop strings, bad words, and the per-sequence
`OutputStream` that turns sampled ids into the text deltas a client sees.

May import: core/, the standard library, `tokenizers`, `jinja2`, `gguf`. No gRPC, ZeroMQ, asyncio or torch.
"""
