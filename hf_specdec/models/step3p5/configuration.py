"""Step 3.5 configuration: reads the real ``stepfun-ai/Step-3.5-Flash`` config.json keys.

The checkpoint stores ``num_hidden_layers`` main decoder layers followed by
``num_nextn_predict_layers`` MTP layers (45 + 3 in Step-3.5-Flash). Its per-layer lists
(``layer_types``, ``rope_theta``, ``partial_rotary_factors``, ``swiglu_limits``,
``swiglu_limits_shared``) cover main + MTP layers. This config keeps HF's convention that
``layer_types`` has ``num_hidden_layers`` entries (so ``DynamicCache(config=...)`` and the mask
builders see the main model only) and moves the trailing entries to ``mtp_layer_types``; the other
per-layer lists are kept whole and read through the ``layer_*`` accessors, which take a *global*
layer index ``0 <= i < num_hidden_layers + num_nextn_predict_layers``.

Why not transformers' ``Step3p7TextConfig`` (model_type ``step3p5`` in 5.17–5.24)? It parses
``moe_layers_enum`` and the sliding head count right, but it drops the MTP entries of
``rope_theta``/``partial_rotary_factors``/``swiglu_limits*``, applies ``rope_scaling`` to
``"full_attention"`` instead of the listed ``yarn_only_types``, keeps only the head count of
``attention_other_setting`` (not its KV heads / head_dim), and routes per-layer heads through
``per_layer_config``, whose behaviour differs between 5.17 and 5.23. The parsing here is small, so it
is our own.

Both classes answer to model_type ``step3p5``: importing hf_specdec registers this one with ``AutoConfig``
in place of transformers' (a Step 3.5 checkpoint's config.json says ``step3p5``). A config.json that
transformers' ``Step3p7TextConfig`` itself wrote (it has keys no StepFun config has, ``STEP3P7_TEXT_CONFIG_KEYS``)
still loads as that class (``from_dict``); Step 3.7 checkpoints (model_type ``step3p7``) never reach this
class: their ``Step3p7Config`` builds its text config as ``Step3p7TextConfig`` directly.

Uncertain points about the real format (public sources: StepFun's remote code, vLLM's step3p5 model):
- ``moe_layers_enum`` missing: StepFun's remote code and vLLM make layers ``1..L-1`` MoE (followed
  here); transformers' Step3p7 uses ``3..L-1``. The released config always sets it.
- ``yarn_only_types`` missing or empty: ``rope_scaling`` applies to every layer (as in vLLM).
- Per-layer lists shorter than ``L + M`` (configs without MTP entries): an MTP layer takes the values
  of the first main layer of the same attention type; its swiglu limits are "no clamp".
- ``mtp_layer_types`` missing: MTP blocks are ``"sliding_attention"`` (docs/models.md §4).
- Only the released routing (sigmoid scores + ``router_bias`` for selection) is implemented;
  other ``moe_router_activation`` / ``use_moe_router_bias`` values raise.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

SLIDING = "sliding_attention"
FULL = "full_attention"

# Keys transformers' Step3p7TextConfig writes to every config.json it saves and a StepFun config never has.
STEP3P7_TEXT_CONFIG_KEYS = frozenset({"mlp_layer_types", "n_routed_experts", "num_sliding_attention_heads",
                                      "per_layer_config"})


class Step3p5Config(PretrainedConfig):
    """Config of ``Step3p5ForCausalLM`` (model_type ``step3p5``).

    Field names are the real config.json keys. ``num_key_value_heads`` is an alias of
    ``num_attention_groups`` for HF utilities; ``layer_rope_scaling`` holds config.json's
    ``rope_scaling`` (that name is a deprecated property of ``PretrainedConfig`` in transformers 5).
    """

    model_type = "step3p5"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "num_key_value_heads": "num_attention_groups",
        "num_local_experts": "moe_num_experts",
        "num_experts_per_tok": "moe_top_k",
        "share_expert_dims": "share_expert_dim",
    }

    vocab_size: int = 128896
    hidden_size: int = 4096
    intermediate_size: int = 11264
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_attention_groups: int = 8
    head_dim: int = 128
    attention_other_setting: dict | None = None
    layer_types: list[str] | None = None
    mtp_layer_types: list[str] | None = None
    sliding_window: int | None = 512
    use_rope_layers: list[bool] | None = None
    rope_theta: float | int | list[float | int] = 10000.0
    partial_rotary_factors: list[float | int] | None = None
    layer_rope_scaling: dict | None = None
    yarn_only_types: list[str] | None = None
    max_position_embeddings: int = 262144
    use_head_wise_attn_gate: bool = True
    moe_layers_enum: str | list[int] | None = None
    moe_num_experts: int = 288
    moe_top_k: int = 8
    moe_intermediate_size: int = 1280
    moe_router_scaling_factor: float | int = 1.0
    moe_router_activation: str = "sigmoid"
    use_moe_router_bias: bool = True
    norm_expert_weight: bool = True
    share_expert_dim: int = 1280
    swiglu_limits: list[float | int | None] | None = None
    swiglu_limits_shared: list[float | int | None] | None = None
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    attention_dropout: float | int = 0.0
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """``PretrainedConfig.from_dict``, except that a dict written by transformers' ``Step3p7TextConfig``
        (same model_type) is handed to that class: ``AutoConfig`` keeps giving transformers' config for it."""
        if cls is Step3p5Config and STEP3P7_TEXT_CONFIG_KEYS & config_dict.keys():
            transformers_class = _step3p7_text_config_class()
            if transformers_class is not None:
                return transformers_class.from_dict(config_dict, **kwargs)
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs: Any):
        if "rope_scaling" in kwargs:
            self.layer_rope_scaling = kwargs.pop("rope_scaling")
        self._split_layer_types()
        self._validate()
        super().__post_init__(**kwargs)
        self._reject_unsupported_variants()

    def to_dict(self) -> dict[str, Any]:
        """The config in the checkpoint's own format (what ``save_pretrained`` writes): ``rope_scaling`` (kept here
        as ``layer_rope_scaling``) and one ``layer_types`` list over the main and the MTP layers (split here), so
        that other readers of a saved folder find the rope scaling and every layer's type."""
        output = super().to_dict()
        output["rope_scaling"] = output.pop("layer_rope_scaling", None)
        output["layer_types"] = self.all_layer_types
        output.pop("mtp_layer_types", None)
        return output

    def _split_layer_types(self) -> None:
        n, m = self.num_hidden_layers, self.num_nextn_predict_layers
        types = list(self.layer_types) if self.layer_types is not None else [FULL] * n
        if len(types) >= n + m and self.mtp_layer_types is None:
            self.mtp_layer_types = types[n:n + m]
        self.layer_types = types[:n]
        mtp = list(self.mtp_layer_types or [])[:m]
        self.mtp_layer_types = mtp + [SLIDING] * (m - len(mtp))

    def _validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected {self.num_hidden_layers}")
        if self.moe_router_activation != "sigmoid" or not self.use_moe_router_bias:
            raise ValueError("Step3p5Config supports the released router only: moe_router_activation='sigmoid' "
                             "with use_moe_router_bias=True")
        if SLIDING in self.all_layer_types and self.sliding_window is None:
            raise ValueError("sliding_attention layers need `sliding_window`")

    def _reject_unsupported_variants(self) -> None:
        # Flags some Step 3.5 configs carry; the released model has these values and nothing else is built.
        for key, supported in (("zero_centered", True), ("use_qk_norm", True), ("sink", False),
                               ("att_impl_type", "GQA")):
            if getattr(self, key, supported) != supported:
                raise ValueError(f"Step3p5Config: {key}={getattr(self, key)!r} is not supported (only {supported!r})")

    # ---- per-layer accessors; `i` is a global index over main + MTP layers ----

    @property
    def num_total_layers(self) -> int:
        """Main decoder layers + MTP layers."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def all_layer_types(self) -> list[str]:
        return list(self.layer_types) + list(self.mtp_layer_types or [])

    def layer_type(self, i: int) -> str:
        return self.all_layer_types[i]

    def _other_setting_applies(self, i: int) -> bool:
        other = self.attention_other_setting or {}
        return bool(other) and self.layer_type(i) == other.get("attention_type", SLIDING)

    def layer_num_heads(self, i: int) -> int:
        """Query heads: ``attention_other_setting`` overrides them for its attention type (sliding)."""
        if self._other_setting_applies(i):
            return self.attention_other_setting.get("num_attention_heads", self.num_attention_heads)
        return self.num_attention_heads

    def layer_num_kv_heads(self, i: int) -> int:
        if self._other_setting_applies(i):
            return self.attention_other_setting.get("num_attention_groups", self.num_attention_groups)
        return self.num_attention_groups

    def layer_head_dim(self, i: int) -> int:
        if self._other_setting_applies(i):
            return self.attention_other_setting.get("head_dim", self.head_dim)
        return self.head_dim

    def layer_sliding_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_type(i) == SLIDING else None

    def _by_layer(self, values, i: int, default):
        """Entry `i` of a per-layer list; past its end, the entry of the first layer of the same type."""
        if values is None:
            return default
        if not isinstance(values, (list, tuple)):
            return values
        if i < len(values):
            return values[i]
        same_type = [j for j in range(len(values)) if self.layer_type(j) == self.layer_type(i)]
        return values[same_type[0]] if same_type else default

    def layer_rope_theta(self, i: int) -> float:
        return float(self._by_layer(self.rope_theta, i, 10000.0))

    def layer_partial_rotary_factor(self, i: int) -> float:
        return float(self._by_layer(self.partial_rotary_factors, i, 1.0))

    def layer_uses_rope(self, i: int) -> bool:
        return bool(self._by_layer(self.use_rope_layers or None, i, True))

    def layer_rope_scaling_params(self, i: int) -> dict | None:
        """``rope_scaling`` if layer `i`'s type is in ``yarn_only_types`` (all layers when that is unset)."""
        if not self.layer_rope_scaling:
            return None
        if self.yarn_only_types and self.layer_type(i) not in self.yarn_only_types:
            return None
        return dict(self.layer_rope_scaling)

    def layer_swiglu_limit(self, i: int, shared: bool) -> float | None:
        """Clamp bound of layer `i`: routed experts (``swiglu_limits``) or dense / shared expert
        (``swiglu_limits_shared``). ``0``, ``None`` or a missing entry mean no clamp."""
        limits = self.swiglu_limits_shared if shared else self.swiglu_limits
        value = limits[i] if limits is not None and i < len(limits) else None
        return float(value) if value else None

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_layer_indices

    @property
    def moe_layer_indices(self) -> set[int]:
        """``moe_layers_enum`` ("3,4,...,44" or a list); unset means layers 1..L-1 (StepFun's default)."""
        enum = self.moe_layers_enum
        if enum is None:
            return set(range(1, self.num_hidden_layers))
        items = enum.split(",") if isinstance(enum, str) else enum
        return {int(x) for x in items if str(x).strip()}


def _step3p7_text_config_class():
    """transformers' ``Step3p7TextConfig``, or None where the installed version has no Step 3.7."""
    try:
        from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    except ImportError:
        return None
    return Step3p7TextConfig


__all__ = ["Step3p5Config", "STEP3P7_TEXT_CONFIG_KEYS"]
