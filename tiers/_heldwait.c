/* A short request and its reply without giving up the GIL (tiers/wire/held_wait.py).
 *
 * pyzmq releases the GIL around every send and receive.  In a serving engine
 * another thread (SGLang's scheduler) waits for the GIL at every moment and
 * takes it at each release; our thread then waits for the scheduler's next
 * yield, 0.5-1 ms, once per release: a 250 us lookup took 1-3 ms in the real
 * server.  These functions are called through ctypes.PyDLL, which keeps the
 * GIL: they send without blocking, spin on ZMQ_EVENTS for a bounded time (no
 * longer than CPython lets any thread hold the GIL, 5 ms) and receive a
 * message that is already there, never blocking.  A daemon's loop sends its replies here too
 * (heldwait_send_routed): a worker thread running Python would otherwise hold each send up.
 *
 * libzmq is the one pyzmq loaded: its functions are handed over once
 * (heldwait_bind), so nothing here links against a second copy.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define ZMQ_EVENTS_OPT 15 /* ZMQ_EVENTS */
#define ZMQ_POLLIN_FLAG 1
#define ZMQ_DONTWAIT_FLAG 1
#define ZMQ_SNDMORE_FLAG 2

typedef struct { unsigned char bytes[64]; } __attribute__((aligned(8))) zmq_message; /* zmq_msg_t */

static int (*z_send)(void *socket, const void *buf, size_t len, int flags);
static int (*z_getsockopt)(void *socket, int option, void *value, size_t *len);
static int (*z_msg_init)(zmq_message *msg);
static int (*z_msg_recv)(zmq_message *msg, void *socket, int flags);
static int (*z_msg_close)(zmq_message *msg);
static void *(*z_msg_data)(zmq_message *msg);
static size_t (*z_msg_size)(const zmq_message *msg);
static int (*z_msg_more)(const zmq_message *msg);

/* Hand over libzmq's functions (their addresses in the library pyzmq uses). */
void heldwait_bind(void *send, void *getsockopt, void *msg_init, void *msg_recv, void *msg_close, void *msg_data,
                   void *msg_size, void *msg_more)
{
    z_send = send;
    z_getsockopt = getsockopt;
    z_msg_init = msg_init;
    z_msg_recv = msg_recv;
    z_msg_close = msg_close;
    z_msg_data = msg_data;
    z_msg_size = msg_size;
    z_msg_more = msg_more;
}

/* Send one single-part message without blocking: 0 sent, else the errno (EAGAIN: not connected yet). */
int heldwait_send(void *socket, const void *buf, int64_t len)
{
    if (z_send(socket, buf, (size_t)len, ZMQ_DONTWAIT_FLAG) >= 0)
        return 0;
    return errno ? errno : EAGAIN;
}

/* Send a daemon's reply through its ROUTER without blocking: the peer's routing id, then the one-part reply.
 * 0 sent, else the errno (EAGAIN: the peer's queue is full; EHOSTUNREACH: the peer left).  The daemon's loop
 * sends here holding the GIL: through pyzmq each send gives it up, and a worker thread running Python
 * then keeps the loop waiting up to CPython's switch interval (5 ms) a send. */
int heldwait_send_routed(void *socket, const void *ident, int64_t ident_len, const void *buf, int64_t len)
{
    if (z_send(socket, ident, (size_t)ident_len, ZMQ_DONTWAIT_FLAG | ZMQ_SNDMORE_FLAG) < 0)
        return errno ? errno : EAGAIN;
    if (z_send(socket, buf, (size_t)len, ZMQ_DONTWAIT_FLAG) >= 0)
        return 0;
    return errno ? errno : EAGAIN;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wait up to spin_ns for a message on socket, then receive it (up to max_parts parts) into msgs:
 * the number of parts (each part's data and size: heldwait_part), 0 when none came in time,
 * -1 on an error, -2 when it had more parts than max_parts (the rest were dropped).
 * The caller closes the parts with heldwait_close. */
int64_t heldwait_recv(void *socket, int64_t spin_ns, zmq_message *msgs, int64_t max_parts)
{
    int64_t until = now_ns() + spin_ns;
    for (;;) {
        int events = 0;
        size_t size = sizeof events;
        if (z_getsockopt(socket, ZMQ_EVENTS_OPT, &events, &size) != 0)
            return -1;
        if (events & ZMQ_POLLIN_FLAG)
            break;
        if (now_ns() >= until)
            return 0;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
    int64_t parts = 0;
    for (;;) {
        zmq_message spare, *msg = parts < max_parts ? &msgs[parts] : &spare;
        z_msg_init(msg);
        if (z_msg_recv(msg, socket, ZMQ_DONTWAIT_FLAG) < 0) {
            z_msg_close(msg);
            for (int64_t i = 0; i < parts && i < max_parts; i++)
                z_msg_close(&msgs[i]);
            return -1;
        }
        int more = z_msg_more(msg);
        if (msg == &spare)
            z_msg_close(msg);
        parts++;
        if (!more)
            break;
    }
    if (parts > max_parts) {
        for (int64_t i = 0; i < max_parts; i++)
            z_msg_close(&msgs[i]);
        return -2;
    }
    return parts;
}

/* The data and size of a received part. */
void *heldwait_part(zmq_message *msgs, int64_t index, int64_t *size)
{
    *size = (int64_t)z_msg_size(&msgs[index]);
    return z_msg_data(&msgs[index]);
}

void heldwait_close(zmq_message *msgs, int64_t parts)
{
    for (int64_t i = 0; i < parts; i++)
        z_msg_close(&msgs[i]);
}
