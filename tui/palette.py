"""The console's colours, in one place, and always next to a word or a symbol.

Fixed colour names rather than theme variables: a state's colour is part of
its meaning (lost is red in every theme), and snapshots stay the same.
"""

NODE_STATE_STYLE = {
    "ready": "bold green",
    "suspect": "bold yellow",
    "lost": "bold white on red",
    "cordoned": "bold magenta",
    "draining": "bold dark_orange",
    "unknown": "dim",
}

REPLICA_TONE_STYLE = {
    "ready": "green",
    # Up, but its leader makes no progress: no new requests go to it.
    "degraded": "bold black on dark_orange",
    "starting": "bold yellow",
    "backoff": "bold magenta",
    "failing": "bold white on red",
    "gone": "dim",
}

# GPU cells: the holder's letter on its tone's colour.
GPU_CELL_STYLE = {
    "free": "grey50",
    "ready": "black on green",
    "degraded": "black on dark_orange",
    "starting": "black on yellow",
    "failing": "white on red",
    "broken": "bold white on dark_red",  # ✗: the GPU is unhealthy (XID, ECC, lost)
    "foreign": "black on grey70",  # f: held by a process llmgw did not start
}

EVENT_STYLE = {
    "lost": "bold red",
    "failed": "bold red",
    "suspect": "yellow",
    "reaping": "red",
    "gone": "dim",
    "ready": "green",
    "joined": "green",
    "cordoned": "magenta",
    "draining": "dark_orange",
    "uncordoned": "cyan",
    "launching": "cyan",
    "pending": "yellow",
    "degraded": "bold dark_orange",
    "recovered": "green",
    "backoff": "magenta",
    "auto-cordon-withheld": "magenta",
}

STORY_STYLE = "bold cyan"
# A herd: many events of one kind summarised in one line.
HERD_STYLE = "bold"
