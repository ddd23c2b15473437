"""Pieces every rl-msprobe report shares: the page style and tables (`html`), markdown tables
(`markdown`), and matplotlib when it can be had (`plot`) — so that a report without it still
writes, and says why it has no pictures."""
