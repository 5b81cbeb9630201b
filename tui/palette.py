"""The console's colours, in one place, and always next to a word or a symbol.

Fixed colour names rather than theme variables: a state's colour is part of
its meaning (lost is red in every theme), and snapshots stay the same.
Keyed by the vocabularies' members, so a renamed word cannot lose its colour.
"""

from llmgw.shared.states import EventWhat, NodeState

from .model import Tone

NODE_STATE_STYLE: dict[str, str] = {
    NodeState.READY: "bold green",
    NodeState.SUSPECT: "bold yellow",
    NodeState.LOST: "bold white on red",
    NodeState.CORDONED: "bold magenta",
    NodeState.DRAINING: "bold dark_orange",
    NodeState.UNKNOWN: "dim",
}

REPLICA_TONE_STYLE: dict[str, str] = {
    Tone.READY: "green",
    # Up, but its leader makes no progress: no new requests go to it.
    Tone.DEGRADED: "bold black on dark_orange",
    # A warm spare: up and loaded, routed nothing until promoted.
    Tone.STANDBY: "cyan",
    Tone.STARTING: "bold yellow",
    Tone.BACKOFF: "bold magenta",
    Tone.FAILING: "bold white on red",
    Tone.GONE: "dim",
}

# GPU cells: the holder's letter on its tone's colour.
GPU_CELL_STYLE: dict[str, str] = {
    Tone.FREE: "grey50",
    Tone.READY: "black on green",
    Tone.DEGRADED: "black on dark_orange",
    Tone.STANDBY: "black on cyan",
    Tone.STARTING: "black on yellow",
    Tone.FAILING: "white on red",
    Tone.BROKEN: "bold white on dark_red",  # ✗: the GPU is unhealthy (XID, ECC, lost)
    Tone.FOREIGN: "black on grey70",  # f: held by a process llmgw did not start
}

EVENT_STYLE: dict[str, str] = {
    EventWhat.LOST: "bold red",
    EventWhat.FAILED: "bold red",
    EventWhat.SUSPECT: "yellow",
    EventWhat.REAPING: "red",
    EventWhat.GONE: "dim",
    EventWhat.READY: "green",
    EventWhat.JOINED: "green",
    EventWhat.CORDONED: "magenta",
    EventWhat.DRAINING: "dark_orange",
    EventWhat.UNCORDONED: "cyan",
    EventWhat.LAUNCHING: "cyan",
    EventWhat.PENDING: "yellow",
    EventWhat.DEGRADED: "bold dark_orange",
    EventWhat.STANDBY: "cyan",
    EventWhat.RESTARTING: "yellow",
    EventWhat.RECOVERED: "green",
    EventWhat.BACKOFF: "magenta",
    EventWhat.AUTO_CORDON_WITHHELD: "magenta",
}

STORY_STYLE = "bold cyan"
# A herd: many events of one kind summarised in one line.
HERD_STYLE = "bold"
