"""Training the drafters eyas serves: row compiler, objectives, data, trainer."""
