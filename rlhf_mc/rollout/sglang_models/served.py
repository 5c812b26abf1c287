"""The registry reads EntryClass from each module of the package (sglang.srt.models.registry.import_model_classes)."""

from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.models.mistral import MistralForCausalLM
from sglang.srt.models.qwen2 import Qwen2ForCausalLM
from sglang.srt.models.qwen3 import Qwen3ForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

EntryClass = [LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Qwen3MoeForCausalLM,
              Glm4MoeForCausalLM, DeepseekV3ForCausalLM]
