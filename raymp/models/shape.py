"""The ModelShape of a configured model: what the layout rules (raymp.layout_rules) check a layout
against. One function for the built-in model, Hugging Face models and factory modules, so config
validation, the planner and the driver judge a layout by the same sizes."""

from __future__ import annotations

from raymp.layout_rules import ModelShape

TOKENIZER_VOCAB = {"byte": 256, "gpt2": 50257}


def model_shape(model_cfg, vocab_size: int | None, tokenizer: str | None = None) -> ModelShape:
    """`vocab_size`: the tokenizer's (None when unknown before the data is loaded); model.vocab_size
    wins when set. `tokenizer` names where the vocabulary comes from in messages."""
    vocab = model_cfg.vocab_size or vocab_size
    if model_cfg.hf is not None or model_cfg.hf_config is not None:
        from raymp.models.hf import experts_key, load_hf_config, tensor_parallel_dims

        hf = load_hf_config(model_cfg.hf, model_cfg.hf_config)
        where = (
            "model.hf_config"
            if model_cfg.hf_config is not None
            else f"config.json of model.hf ({model_cfg.hf})"
        )
        sizes = tuple((name, size, False) for name, size in tensor_parallel_dims(hf).items())
        layers = "n_layer" if hf.model_type == "gpt2" else "num_hidden_layers"
        # Llama-like glue plans sequence parallelism; GPT-2's adds learned positions to each
        # slice of the sequence, which it does not plan.
        return ModelShape(
            model_cfg.n_layers,
            sizes,
            sequence_parallel=hf.model_type != "gpt2",
            experts=model_cfg.moe is not None,
            # transformers' experts modules shard over ep (raymp.parallel.experts); no TP plan
            ep_experts=model_cfg.moe.n_experts if model_cfg.moe is not None else None,
            expert_tp_plan=False,
            kind=f"the Hugging Face {hf.model_type} model",
            layers_field=f"{layers} in {where}",
            experts_field=f"{experts_key(hf)} in {where}",
            sizes_in=where,
        )
    vocab_entry = (
        ()
        if vocab is None
        else (
            (
                (
                    "model.vocab_size"
                    if model_cfg.vocab_size
                    else f"the vocabulary of the {tokenizer or 'data'} tokenizer"
                ),
                vocab,
                True,
            ),
        )
    )
    if model_cfg.factory is not None:
        from raymp.models.custom import STAGEABLE_NEEDED, FactorySpec

        spec = FactorySpec.from_model_config(model_cfg, vocab or 256, 0)
        return ModelShape(
            spec.num_layers if spec.stageable else model_cfg.n_layers,
            vocab_entry,
            tp_plan=model_cfg.factory_tp_plan is not None,
            not_stageable="" if spec.stageable else STAGEABLE_NEEDED,
            kind="model.factory's module",
            layers_field="the layer count of model.factory's module",
        )
    return ModelShape.built_in(model_cfg.n_layers, model_cfg.n_heads, model_cfg.n_kv_heads, model_cfg.ffn_dim,
                               vocab_entry, model_cfg.moe)


def probed_shape(model: dict) -> dict:
    """ModelConfig's shape fields read off a Hugging Face config or a factory's module (built on
    the meta device), for a `model` section (raw data) that names one. ValueError if it cannot be read."""
    if model.get("hf") is not None or model.get("hf_config") is not None:
        from raymp.models.hf import HFModelError, load_hf_config, shape_fields

        try:
            return shape_fields(load_hf_config(model.get("hf"), model.get("hf_config")))
        except HFModelError as exc:
            raise ValueError(str(exc)) from None
    if model.get("factory") is not None:  # built on the meta device: torch, only for a factory
        from raymp.models.custom import factory_shape

        return factory_shape(model["factory"], model.get("vocab_size") or 256)
    raise ValueError("the model section names no Hugging Face model or factory to read a shape off")
