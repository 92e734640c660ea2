"""Annotation files read with their errors in one line naming the file, line and column: JSON (COCO),
XML (Pascal VOC, elements keep their line for later messages), YAML (YOLO's data.yaml: `read_yaml`,
config.py's, the reader config files use too)."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from xml.parsers import expat

from ..config import read_yaml

__all__ = ["Element", "read_json", "read_xml", "read_yaml"]


def read_json(path: Path):
    """The JSON value in `path`; not JSON: a ValueError naming the file, line and column."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text, so not JSON (byte {error.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}, line {error.lineno}, column {error.colno}: not valid JSON ({error.msg})") from None


@dataclass
class Element:
    """An XML element: its tag, text (stripped), children and the line it starts on."""

    tag: str
    line: int
    text: str = ""
    children: list = field(default_factory=list)

    def find(self, tag: str):
        """The first child of this tag, or None."""
        return next((child for child in self.children if child.tag == tag), None)

    def find_all(self, tag: str) -> list:
        return [child for child in self.children if child.tag == tag]


def read_xml(path: Path) -> Element:
    """The root element of the XML file `path` (expat, as ElementTree, but keeping each element's
    line); not XML: a ValueError naming the file, line and column. External entities are not read."""
    parser = expat.ParserCreate()
    stack = [Element("", 0)]

    def start(tag, attributes):
        element = Element(tag, parser.CurrentLineNumber)
        stack[-1].children.append(element)
        stack.append(element)

    def end(tag):
        element = stack.pop()
        element.text = element.text.strip()

    def text(data):
        stack[-1].text += data

    parser.StartElementHandler, parser.EndElementHandler, parser.CharacterDataHandler = start, end, text
    try:
        with open(path, "rb") as file:
            parser.ParseFile(file)
    except expat.ExpatError as error:
        reason = expat.ErrorString(error.code)
        raise ValueError(f"{path}, line {error.lineno}, column {error.offset + 1}: not valid XML ({reason})") from None
    return stack[0].children[0]
