"""The runtime a training rank embeds: heartbeats, plans, recovery, state, data."""
