"""Chat templates built for the tests: three styles the turn builder must handle exactly."""

from jax_agent_rl.tokenization import chat_template

CHATML_TOOLS = chat_template("chatml_tools")

# Qwen3-style: like ChatML with tools, but assistant messages before the last user message
# lose their <think>...</think> reasoning when the conversation is rendered again.
QWEN3_STYLE = """
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for t in tools %}{{- '\\n' + t | tojson }}{% endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {%- set content = m.content or '' %}
        {%- if loop.index0 < ns.last_user and '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- for c in m.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + c.function.name + '", "arguments": ' + c.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}
"""

# Llama-3 style: header tokens, <|eot_id|> ends every turn, tool results in an ipython turn.
LLAMA3_STYLE = """
{{- bos_token }}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these functions:\\n' }}
    {%- for t in tools %}{{- t | tojson + '\\n' }}{% endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}
    {%- elif m.role == 'assistant' and m.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for c in m.tool_calls %}
            {%- if not loop.first %}{{- '; ' }}{% endif %}
            {{- '{"name": "' + c.function.name + '", "parameters": ' + c.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content or '') + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}
"""

LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
