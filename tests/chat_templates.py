"""Chat templates of two model families, written compactly for tests, and the tiny tokenizer carrying one.

- ``QWEN3_STYLE``: Qwen3's rules (DeepSeek-R1 and other reasoning models behave alike): reasoning
  comes from ``reasoning_content`` or from ``<think>…</think>`` at the start of the content; an
  assistant turn before the last user turn is rendered without it, the last turns with it (the
  very last one always, with an empty block when it has none); tool calls are rendered after the
  content as ``<tool_call>`` blocks, tool results as ``<tool_response>`` inside a user turn.
- ``LLAMA31_STYLE``: Llama 3.1's layout, which rewrites nothing: every turn's content is trimmed
  and rendered as it is (``reasoning_content`` is not read); an assistant turn with tool calls
  renders them as JSON, a tool turn is an ``ipython`` turn.
"""

from __future__ import annotations

from pathlib import Path

from tiny_tokenizers import save_tiny_tokenizer

QWEN3_STYLE = """\
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}{%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}\
{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{%- set content = message.content or '' -%}
{%- set reasoning = '' -%}
{%- if message.reasoning_content is defined and message.reasoning_content is not none -%}
{%- set reasoning = message.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + call.arguments | tojson + '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

LLAMA31_STYLE = """\
{%- for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}' -}}
{%- endfor -%}
{{- '<|eot_id|>' -}}
{%- else -%}
{%- set role = 'ipython' if message.role == 'tool' else message.role -%}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""

# Added as Qwen3 and Llama 3.1 add them: the think tags as plain (decoded) tokens, the headers as special ones.
THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
LLAMA_SPECIAL_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def save_templated_tokenizer(out_dir: Path, template: str) -> Path:
    """The tiny tokenizer with ``template`` as its chat template (and the tokens the template uses)."""
    from transformers import AutoTokenizer
    save_tiny_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.add_tokens(LLAMA_SPECIAL_TOKENS, special_tokens=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
