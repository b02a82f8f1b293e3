"""Model kinds shared by the state / lifecycle / matrix tests. ``GAN`` is keras-io's
``guides/custom_train_step_in_tensorflow.py`` GAN, shrunk: a ``keras.Model`` subclass WITHOUT ``call()``, its own
``compile(d_optimizer=..., g_optimizer=...)`` and a ``train_step`` applying two optimizers (held as attributes, or in
a dict with ``in_dict=True``)."""
import keras
import numpy as np
import tensorflow as tf

LATENT, FEATURES = 4, 6
GAN_X = np.random.RandomState(0).normal(size=(64, FEATURES)).astype("float32")


class GAN(keras.Model):
    def __init__(self, in_dict=False, gen_nan=False):
        super().__init__()
        self.discriminator = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"),
                                               keras.layers.Dense(1)], name="discriminator")
        self.generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(FEATURES)], name="generator")
        self.in_dict = in_dict
        self.gen_nan = gen_nan  # the generator's loss (and so only its gradients) is NaN
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        if self.in_dict:
            self.optimizers = {"disc": d_optimizer, "gen": g_optimizer}
        else:
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = loss_fn

    def opt(self, which):
        return self.optimizers[which] if self.in_dict else getattr(self, which[0] + "_optimizer")

    def train_step(self, real):
        if isinstance(real, tuple):
            real = real[0]
        batch_size = tf.shape(real)[0]
        z = keras.random.normal(shape=(batch_size, LATENT), seed=self.seed_generator)
        combined = tf.concat([self.generator(z), real], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((tf.shape(real)[0], 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.opt("disc").apply(grads, self.discriminator.trainable_weights)
        z = keras.random.normal(shape=(batch_size, LATENT), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(z)))
            if self.gen_nan:
                g_loss = g_loss * float("nan")
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.opt("gen").apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def make_gan(in_dict=False, gen_nan=False, seed=5):
    keras.utils.set_random_seed(seed)
    gan = GAN(in_dict=in_dict, gen_nan=gen_nan)
    gan.compile(d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.Adam(1e-3),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


def gan_weights(gan):
    return [v.numpy().copy() for v in gan.discriminator.weights + gan.generator.weights]
