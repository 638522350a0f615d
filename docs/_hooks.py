"""MkDocs hook: the docstrings are written with Sphinx roles (:class:`X`, :meth:`y`); the API
reference shows them as plain code, without the role prefix, and turns a reST ``::`` into ``:``."""

import re

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj|const):(?=<code>)")
_LITERAL = re.compile(r"::(?=</p>)")


def on_page_content(html, page, config, files):
    if "::" not in html and ":<code>" not in html:
        return html
    return _LITERAL.sub(":", _ROLE.sub("", html))
