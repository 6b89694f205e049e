"""Tagged blocks in model text (``<answer>...</answer>``), found in linear time: what rewards
and environments read a policy's answer by."""


def tagged(text: str, tag: str = "answer") -> list[str]:
    """The contents of ``text``'s ``<tag>...</tag>`` blocks in order, each ending at the first
    closing tag after it: what ``re.findall(r"<tag>(.*?)</tag>", text, re.DOTALL)`` finds, in
    time linear in ``text``. (That regex scans the rest of the text from every opening tag it
    cannot close, so 20,000 unclosed ``<answer>`` took it most of a minute.)"""
    opening, closing = f"<{tag}>", f"</{tag}>"
    found, at = [], 0
    while (start := text.find(opening, at)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break  # no closing tag after this opening one: none after a later one either
        found.append(text[start + len(opening) : end])
        at = end + len(closing)
    return found
