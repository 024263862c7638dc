"""Chat templates for the format names mergekit 0.1.5's `chat_template:` accepts (alpaca, chatml,
exaone, llama3, mistral), written here in our own words.

mergekit looks a short name up among the templates shipped in its package; that text is its
data, not ours. Each template below renders, for every conversation (system, user, assistant
turns; add_generation_prompt on and off) under the settings transformers renders chat templates
with (trim_blocks, lstrip_blocks), the same string as mergekit's file of that name, including
its whitespace (the exaone format's indentation and the llama3 format's newline after each turn
are part of what mergekit's files render), and refuses the conversations it refuses (mistral:
roles that do not alternate). Every tag trims the whitespace around it, so all output text comes
from the expressions and the rendering does not depend on those settings.
`tests/test_mergekit_chat_formats.py` checks both against mergekit's files.
"""
from __future__ import annotations

# Each turn's header by role; other roles (system) are left out of the turns.
_ALPACA = """\
{#- the last system message, trimmed, then a blank line -#}
{%- set state = namespace(system="") -%}
{%- for m in messages if m.role == "system" -%}
  {%- set state.system = m.content | trim -%}
{%- endfor -%}
{{- state.system ~ "\\n\\n" -}}
{%- set header = {"user": "### Instruction:\\n", "assistant": "### Response:\\n",
                  "user_context": "### Input:\\n"} -%}
{%- for m in messages -%}
  {%- if m.role in header -%}
    {{- header[m.role] ~ (m.content | trim) ~ ("" if loop.last else "\\n\\n") -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and messages[-1].role != "assistant" -%}
  {{- "### Response:\\n" -}}
{%- endif -%}
"""

_CHATML = """\
{%- for m in messages -%}
  {{- "<|im_start|>" ~ m.role ~ "\\n" ~ m.content ~ "<|im_end|>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|im_start|>assistant\\n" -}}
{%- endif -%}
"""

# The format's turns carry four or eight spaces of indentation and a blank line after each.
_EXAONE = """\
{%- set indent = "    " -%}
{%- for m in messages -%}
  {%- if loop.first and m.role != "system" -%}
    {{- indent ~ indent ~ "[|system|][|endofturn|]\\n\\n" -}}
  {%- endif -%}
  {{- indent ~ "[|" ~ m.role ~ "|]" ~ m.content ~ "\\n" -}}
  {{- indent ~ indent ~ ("\\n" if m.role == "user" else "[|endofturn|]\\n") ~ "\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- indent ~ "[|assistant|]\\n" -}}
{%- endif -%}
"""

_LLAMA3 = """\
{%- for m in messages -%}
  {{- (bos_token if loop.first else "") ~ "<|start_header_id|>" ~ m.role ~ "<|end_header_id|>\\n\\n"
      ~ (m.content | trim) ~ "<|eot_id|>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" -}}
{%- endif -%}
"""

# An optional system message first, folded into the first user turn; then user and assistant
# strictly alternating, starting with the user.
_MISTRAL = """\
{%- set has_system = messages[0].role == "system" -%}
{%- set turns = messages[1:] if has_system else messages -%}
{{- bos_token -}}
{%- for m in turns -%}
  {%- if (m.role == "user") != (loop.index0 is even) -%}
    {{- raise_exception("the turns after an optional first system message must go user, assistant, user, ...") -}}
  {%- endif -%}
  {%- if m.role == "user" -%}
    {%- set prompt = messages[0].content ~ "\\n\\n" ~ m.content if loop.first and has_system else m.content -%}
    {{- " [INST] " ~ prompt ~ " [/INST]" -}}
  {%- elif m.role == "assistant" -%}
    {{- " " ~ m.content ~ eos_token -}}
  {%- else -%}
    {{- raise_exception("roles are user and assistant, after an optional first system message") -}}
  {%- endif -%}
{%- endfor -%}
"""

# name -> template text; the names are those of mergekit 0.1.5's mergekit/_data/chat_templates
NAMED = {"alpaca": _ALPACA, "chatml": _CHATML, "exaone": _EXAONE, "llama3": _LLAMA3, "mistral": _MISTRAL}
