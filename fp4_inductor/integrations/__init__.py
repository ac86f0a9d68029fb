"""Eager attention for frameworks' own attention registries: ``attn_implementation="fp4attn"``
in transformers (registered on ``import fp4_inductor`` where transformers is installed), and
an attention processor for diffusers models (``integrations.diffusers.use_fp4attn``)."""
