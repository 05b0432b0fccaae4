// implemented by the models work
