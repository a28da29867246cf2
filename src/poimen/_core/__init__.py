"""The pure rules: effect classes, intents and their transitions, keys, decisions, tool
registrations and specs. No I/O; imports nothing of poimen above `errors`."""
