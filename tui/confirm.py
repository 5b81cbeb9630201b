"""Asks before an operator action changes the cluster; answers True or False."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class Confirm(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str = "", consequence: str = "") -> None:
        super().__init__()
        self.question = question
        self.consequence = consequence

    def ask(self, question: str, consequence: str) -> Confirm:
        """The same screen asks again (the app installs one: a screen composed anew for
        every question cost a key hundreds of milliseconds on a busy machine)."""
        self.question, self.consequence = question, consequence
        if self.is_mounted:
            self.query_one("#question", Static).update(question)
            self.query_one("#consequence", Static).update(consequence)
        return self

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Static(self.question, id="question")
            yield Static(self.consequence, id="consequence")
            with Horizontal(id="answers"):
                yield Button("Yes (y)", variant="warning", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # Enter on its own changes nothing

    def on_screen_resume(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
