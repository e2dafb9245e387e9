package org.edgekv.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNotSame;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertSame;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.List;
import org.junit.Test;

public class StateBookTest {
    private static ByteBuffer marked(Manifest.StateTensor s, long mark) {
        ByteBuffer b = ByteBuffer.allocateDirect((int) s.bytes).order(ByteOrder.nativeOrder());
        b.putLong(0, mark);
        b.putLong((int) s.bytes - 8, mark);
        return b;
    }

    @Test
    public void allocatesZeroedBuffersOfTheManifestSizes() {
        Manifest m = TestSupport.fixtureManifest();
        StateBook<ByteBuffer> book = new StateBook<>(m, StateBook.DIRECT_BUFFERS);
        assertEquals(60, book.size());
        assertEquals(m.stateBytes, book.bytes());
        for (int i = 0; i < book.size(); i++) {
            ByteBuffer b = book.past(i);
            assertTrue(b.isDirect());
            assertEquals(ByteOrder.nativeOrder(), b.order());
            assertEquals(196608, b.capacity());
            for (int k = 0; k < b.capacity(); k += 4096) {
                assertEquals(0, b.get(k));
            }
            assertEquals(0L, b.getLong(b.capacity() - 8));
        }
    }

    @Test
    public void swapFeedsEachPresentBackAsItsOwnPast() {
        Manifest m = TestSupport.fixtureManifest();
        StateBook<ByteBuffer> book = new StateBook<>(m, StateBook.DIRECT_BUFFERS);
        List<ByteBuffer> zeros = book.pasts();
        for (int step = 1; step <= 3; step++) {
            // a runtime that returns the outputs in reverse order, by name: the book must still pair them by index
            for (int i = book.size() - 1; i >= 0; i--) {
                Manifest.StateTensor s = book.spec(i);
                book.putPresent(s.output, marked(s, step * 1000L + i));
            }
            List<ByteBuffer> old = book.swap();
            assertEquals(step, book.steps());
            for (int i = 0; i < book.size(); i++) {
                // present.{L}.{key,value} became past_key_values.{L}.{key,value}: same tensor index, this step's mark
                assertEquals(step * 1000L + i, book.past(i).getLong(0));
                assertEquals(step * 1000L + i, book.past(i).getLong((int) book.spec(i).bytes - 8));
                if (step == 1) {
                    assertSame(zeros.get(i), old.get(i)); // the zero state came back for recycling
                } else {
                    assertEquals((step - 1) * 1000L + i, old.get(i).getLong(0));
                }
            }
        }
        assertEquals("past_key_values.0.key", book.spec(0).input);
        assertEquals("past_key_values.0.value", book.spec(1).input);
        assertEquals("present.29.value", book.spec(59).output);
    }

    @Test
    public void aStateUpdatedInPlaceStaysAndIsNotHandedBackForFreeing() {
        Manifest m = TestSupport.fixtureManifest();
        StateBook<ByteBuffer> book = new StateBook<>(m, StateBook.DIRECT_BUFFERS);
        List<ByteBuffer> zeros = book.pasts();
        for (int i = 0; i < book.size(); i++) {
            // tensor 0 comes back as a new buffer; the others are the pasts themselves (present bound to past)
            book.putPresent(i, i == 0 ? marked(book.spec(i), 7L) : book.past(i));
        }
        List<ByteBuffer> old = book.swap();
        assertSame(zeros.get(0), old.get(0));
        assertEquals(7L, book.past(0).getLong(0));
        for (int i = 1; i < book.size(); i++) {
            assertNull(old.get(i));
            assertSame(zeros.get(i), book.past(i));
        }
    }

    @Test
    public void aMissingPresentNamesTheOutput() {
        Manifest m = TestSupport.fixtureManifest();
        StateBook<ByteBuffer> book = new StateBook<>(m, StateBook.DIRECT_BUFFERS);
        for (int i = 0; i < book.size(); i++) {
            if (i != 7) {
                book.putPresent(i, marked(book.spec(i), i));
            }
        }
        try {
            book.swap();
            fail();
        } catch (EdgekvException e) {
            assertEquals("step 0: the runtime did not return 1 state output(s): [present.3.value]", e.getMessage());
        }
    }

    @Test
    public void aWrongByteCountIsRefused() {
        Manifest m = TestSupport.fixtureManifest();
        StateBook<ByteBuffer> book = new StateBook<>(m, StateBook.DIRECT_BUFFERS);
        try {
            book.putPresent("present.0.key", ByteBuffer.allocateDirect(196608 * 2)); // float32 instead of float16
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().startsWith("present.0.key: 393216 bytes returned but the "
                    + "manifest says 196608 (float16 [1, 3, 512, 64])"));
        }
        try {
            book.putPresent("present.30.key", marked(book.spec(0), 1));
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("not a state output of this export"));
        }
        book.putPresent(0, marked(book.spec(0), 1));
        try {
            book.putPresent(0, marked(book.spec(0), 2));
            fail();
        } catch (EdgekvException e) {
            assertEquals("present.0.key: put twice in one step", e.getMessage());
        }
    }

    @Test
    public void resetStartsANewSequenceFromZeros() {
        Manifest m = TestSupport.fixtureManifest();
        StateBook<ByteBuffer> book = new StateBook<>(m, StateBook.DIRECT_BUFFERS);
        for (int i = 0; i < book.size(); i++) {
            book.putPresent(i, marked(book.spec(i), 99));
        }
        book.swap();
        ByteBuffer before = book.past(0);
        book.reset();
        assertEquals(0, book.steps());
        assertNotSame(before, book.past(0));
        assertEquals(0L, book.past(0).getLong(0));
    }

    @Test
    public void checksAllocationsOfOtherSlotKinds() {
        Manifest m = TestSupport.fixtureManifest();
        StateBook.Slots<byte[]> wrong = new StateBook.Slots<byte[]>() {
            @Override
            public byte[] zeros(Manifest.StateTensor spec) {
                return new byte[(int) spec.elements()]; // forgot the dtype size
            }

            @Override
            public long byteSize(byte[] value) {
                return value.length;
            }

            @Override
            public void release(byte[] value) {}
        };
        try {
            new StateBook<>(m, wrong);
            fail();
        } catch (EdgekvException e) {
            assertTrue(e.getMessage(), e.getMessage().startsWith("present.0.key: 98304 bytes allocated"));
        }
    }
}
