"""Files on disk: model sources and their cache, wheel downloads, data sets and the chat history."""
